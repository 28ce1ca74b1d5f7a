"""The example payments app: its routes in process, as deployed under gunicorn, its fake
processor, and gunicorn.conf.py."""

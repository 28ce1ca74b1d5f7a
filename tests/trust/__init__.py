"""Trust boundaries (contract section 7): the request's own body, the key header, what a
replay carries and an answer the store cannot hold, through real apps and gunicorn."""

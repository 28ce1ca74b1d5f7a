"""Code blocks of the README and the docs, read out of their Markdown and run.

The convention, for every fenced block whose language is Python or a shell
(``python``, ``py``, ``sh``, ``shell``, ``bash``, ``console``): after the
language, the fence's info string carries at most these words, which neither
GitHub nor Sphinx shows the reader:

``illustrative``
    Shown, never run: a fragment that needs the reader's own code around it
    (``@require_api_key``, a processor client), or an install command.
``file=PATH``
    Written to PATH in the page's working directory before the blocks after it
    run (an ``app.py``, a ``gunicorn.conf.py``); other languages (``sql``,
    ``ini``) may carry it too.
``background``
    A shell block started in the background (a server, a consumer) and stopped
    when the page is done; the next block waits until the page's port answers,
    or, with ``ready=TEXT``, until TEXT appears in the block's output.
(nothing)
    Run, in order, in the page's working directory: Python as a script, shell
    with ``bash -euo pipefail``. It must exit with 0.

A page's runnable blocks run in one directory, in the order they appear, as a
reader would type them; placeholders the docs use for servers
(``postgresql://localhost/payments``, ``localhost:5000``...) are replaced by
the test's own (``Page.substitutions``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"python", "py", "sh", "shell", "bash", "console"}
SHELLS = RUNNABLE - {"python", "py"}
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_WORD = re.compile(r"^(illustrative|background|file=\S+|ready=\S+)$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    words: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runnable_language(self) -> bool:
        return self.language in RUNNABLE

    @property
    def illustrative(self) -> bool:
        return "illustrative" in self.words

    @property
    def background(self) -> bool:
        return "background" in self.words

    def option(self, name: str) -> str | None:
        for word in self.words:
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None

    def bad_words(self) -> list[str]:
        return [word for word in self.words if not _WORD.match(word)]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file (MyST directives excluded)."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        fence, info, start = match.group("fence"), match.group("info").strip(), i
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = lines[i].strip()
            if closing.startswith(fence[0] * len(fence)) and not closing.strip(fence[0]):
                break
            body.append(lines[i])
            i += 1
        i += 1
        words = info.split()
        if words and not words[0].startswith("{"):
            text = "\n".join(body) + "\n"
            found.append(Block(path, start + 1, words[0], tuple(words[1:]), text))
    return found


def runs(block: Block) -> bool:
    """Whether a page's run includes the block (written or executed)."""
    return not block.illustrative and (block.runnable_language or block.option("file") is not None)


def section_lines(path: Path, heading: str) -> tuple[int, int]:
    """The lines ``[start, end)`` of the section under ``heading`` (to the next
    heading of the same or a higher level), outside code blocks."""
    lines = path.read_text(encoding="utf-8").splitlines()
    in_code = False
    start: int | None = None
    level = 0
    for number, line in enumerate(lines, 1):
        if _FENCE.match(line):
            in_code = not in_code
            continue
        found = None if in_code else re.match(r"^(#+) (.*)$", line)
        if found is None:
            continue
        if start is None and found.group(2).strip() == heading:
            start, level = number, len(found.group(1))
        elif start is not None and len(found.group(1)) <= level:
            return start, number
    if start is None:
        raise KeyError(f"{path.name}: no heading {heading!r}")
    return start, len(lines) + 1


def documents() -> list[Path]:
    """The README and every Markdown page of the docs."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass
class Result:
    block: Block
    output: str


class Page:
    """The runnable blocks of one document, run in ``workdir`` like a reader would."""

    def __init__(
        self,
        path: Path,
        workdir: Path,
        *,
        substitutions: Mapping[str, str],
        env: Mapping[str, str],
        port: int,
        timeout: float = 120.0,
    ) -> None:
        self.path = path
        self.workdir = workdir
        self.substitutions = dict(substitutions)
        self.port = port
        self.timeout = timeout
        venv_bin = str(Path(sys.executable).parent)
        self.env = {
            **os.environ,
            "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(workdir),
            **env,
        }
        self.results: list[Result] = []
        self._background: list[tuple[Block, subprocess.Popen[bytes], Path]] = []

    def substitute(self, text: str) -> str:
        for placeholder, value in self.substitutions.items():
            text = text.replace(placeholder, value)
        return text

    def run(self, *sections: str) -> list[Result]:
        """Run every non-illustrative block of the page, or of the named sections
        (headings, in the order given)."""
        ranges = [section_lines(self.path, name) for name in sections] or [(0, 10**9)]
        for start, end in ranges:
            for block in blocks(self.path):
                if start <= block.line < end and runs(block):
                    self.run_block(block)
        return self.results

    def run_block(self, block: Block) -> Result:
        text = self.substitute(block.text)
        target = block.option("file")
        if target is not None:
            dest = self.workdir / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8")
            result = Result(block, "")
        elif block.background:
            self._start_background(block, text)
            result = Result(block, "")
        else:
            result = Result(block, self._run_foreground(block, text))
        self.results.append(result)
        return result

    def _run_foreground(self, block: Block, text: str) -> str:
        if block.language in SHELLS:
            argv = ["bash", "-euo", "pipefail", "-c", text]
        else:
            script = self.workdir / f"_snippet_{block.line}.py"
            script.write_text(text, encoding="utf-8")
            argv = [sys.executable, script.name]
        try:
            done = subprocess.run(
                argv,
                cwd=self.workdir,
                env=self.env,
                capture_output=True,
                timeout=self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{block.where} ran over {self.timeout} s\n{self.logs()}\n{_text(exc.output)}"
            ) from None
        output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        if done.returncode != 0:
            raise AssertionError(
                f"{block.where} exited with {done.returncode}:\n{text}\n--- output ---\n"
                f"{output}\n{self.logs()}"
            )
        return output

    def _start_background(self, block: Block, text: str) -> None:
        log_path = self.workdir / f"_background_{block.line}.log"
        log: IO[bytes] = log_path.open("wb")
        process = subprocess.Popen(
            ["bash", "-c", text],
            cwd=self.workdir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self._background.append((block, process, log_path))
        ready = block.option("ready")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"{block.where} exited early:\n{self.logs()}")
            if ready is not None:
                if ready in log_path.read_text(errors="replace"):
                    return
            elif _answers(self.port):
                return
            time.sleep(0.1)
        waited_for = ready or f"port {self.port}"
        raise AssertionError(f"{block.where} never became ready ({waited_for})\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {block.where} (background) ---\n{path.read_text(errors='replace')[-4000:]}"
            for block, _, path in self._background
        )

    def stop(self) -> None:
        """Stop the background blocks: SIGTERM to each process group, then SIGKILL."""
        for _, process, _ in reversed(self._background):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for _, process, _ in reversed(self._background):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._background.clear()

    def output_of(self, contains: str) -> str:
        """The output of the (first) block whose text contains ``contains``."""
        for result in self.results:
            if contains in result.block.text:
                return result.output
        raise KeyError(contains)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _text(value: bytes | str | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value or ""


def describe(found: Iterator[Block] | list[Block]) -> str:
    return "\n".join(
        f"{b.where} ({b.language} {' '.join(map(shlex.quote, b.words))})" for b in found
    )

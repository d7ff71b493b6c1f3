"""Headless Chromium driven over the DevTools protocol, for checking and picturing the live view.

Chromium started with `--remote-debugging-pipe` reads protocol commands from file descriptor 3
and writes replies and events to descriptor 4, each message one JSON document ended by a NUL
byte, so no websocket client (and no browser download, as Playwright would need) is involved.
Used by the view's test and by `scripts/server_bench.py` to screenshot the page; the standard
library only.

What it is not: a browser automation library. One page, commands in order, events ignored.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((path for name in EXECUTABLES if (path := shutil.which(name))), None)


class DevToolsError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium with one page; `evaluate` runs JavaScript in it."""

    def __init__(self, executable: str, width: int = 1280, height: int = 900) -> None:
        self.profile = tempfile.TemporaryDirectory(prefix="d3d-chromium-")
        commands_read, self.commands = os.pipe()
        self.replies, replies_write = os.pipe()

        def descriptors() -> None:  # in the child: the pipes become fds 3 and 4
            # Moved above 4 first: a pipe may itself be fd 3 or 4, and dup2 onto itself would
            # neither keep it nor make it inheritable.
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands_read, replies_write)]
            for fd, wanted in zip(high, (3, 4)):
                os.dup2(fd, wanted)

        arguments = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--no-first-run", "--no-default-browser-check", "--hide-scrollbars",
                     "--remote-debugging-pipe", f"--user-data-dir={self.profile.name}",
                     f"--window-size={width},{height}", "about:blank"]
        # close_fds would close 3 and 4 after `descriptors` made them; Python's own descriptors are
        # not inheritable, so nothing else leaks into the browser.
        self.process = subprocess.Popen(arguments, preexec_fn=descriptors, close_fds=False,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_read)
        os.close(replies_write)
        self.buffer = b""
        self.next_id = 0
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command (to the page's session when `session`) and return its result."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.receive()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})

    def receive(self) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            data = os.read(self.replies, 1 << 16)
            if not data:
                raise DevToolsError("Chromium closed the DevTools pipe (did it start?)")
            self.buffer += data
        message, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(message)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise DevToolsError(f"{expression[:60]}…: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 30) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)

    def wait_for(self, condition: str, timeout: float) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(condition)):
            if time.monotonic() > deadline:
                raise DevToolsError(f"not true within {timeout} s: {condition}")
            time.sleep(0.05)
        return value

    def screenshot(self, path: str | Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (DevToolsError, OSError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for descriptor in (self.commands, self.replies):
            os.close(descriptor)
        self.profile.cleanup()

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

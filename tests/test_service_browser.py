"""Headless Chromium check of the service page ``/`` (issue 7): it renders, the form submits, and
both Gantt charts (static and dynamic schedule) appear as inline SVG.

The service runs for real (``flamia serve`` in a subprocess on a free loopback port). The browser
is driven over the Chrome DevTools Protocol through ``--remote-debugging-pipe`` (file descriptors
3 and 4, NUL-separated JSON), so no extra Python package or websocket client is needed.

Install the browser with ``scripts/install_browser.sh`` (Debian: ``apt-get install -y chromium``);
``FLAMIA_CHROMIUM`` may name another binary. The test skips, saying why, only when no browser
binary exists or the binary cannot start on this machine.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _browser() -> str | None:
    env = os.environ.get("FLAMIA_CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CDP:
    """Minimal Chrome DevTools Protocol client over --remote-debugging-pipe."""

    def __init__(self, binary: str, user_dir: str) -> None:
        to_r, self._to_w = os.pipe()  # we write commands -> chrome reads fd 3
        self._from_r, from_w = os.pipe()  # chrome writes fd 4 -> we read

        def child_fds() -> None:  # runs in the child between fork and exec
            a = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10)  # out of the way first: to_r/from_w may be 3 or 4
            b = fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-pipe",
             f"--user-data-dir={user_dir}", "--window-size=1400,1800", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=child_fds, pass_fds=(3, 4), close_fds=True,  # close_fds runs after preexec_fn
        )
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._next = 0

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0) -> dict:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer to {method} within {timeout} s")
            ready, _, _ = select.select([self._from_r], [], [], left)
            if ready:
                chunk = os.read(self._from_r, 1 << 20)
                if not chunk:
                    raise ConnectionError(f"browser closed the pipe (exit code {self.proc.poll()})")
                self._buf += chunk

    def close(self) -> str:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        err = self.proc.stderr.read().decode("utf-8", "replace") if self.proc.stderr else ""
        os.close(self._to_w)
        os.close(self._from_r)
        return err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    d = tmp_path_factory.mktemp("browser-svc")
    env = dict(os.environ, FLAMIA_DB_PATH=str(d / "runs.db"))
    log = open(d / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "flamia_pack.cli", "serve", "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"flamia serve did not come up: {(d / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(20)
    log.close()


@pytest.fixture()
def browser(tmp_path):
    binary = _browser()
    if binary is None:
        pytest.skip("no Chromium binary found (tried $FLAMIA_CHROMIUM, " + ", ".join(CANDIDATES)
                    + "); install it with scripts/install_browser.sh (apt-get install -y chromium)")
    cdp = CDP(binary, tempfile.mkdtemp(dir=tmp_path))
    try:
        cdp.send("Browser.getVersion", timeout=30)
    except (TimeoutError, ConnectionError, RuntimeError) as exc:
        err = cdp.close()
        pytest.skip(f"{binary} cannot run here ({exc}); its stderr ends: {err[-800:]}")
    yield cdp
    cdp.close()


def _eval(cdp: CDP, session: str, expr: str):
    res = cdp.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=session)
    if "exceptionDetails" in res:
        raise RuntimeError(res["exceptionDetails"].get("text", "JS exception"))
    return res["result"].get("value")


def _wait_for(cdp: CDP, session: str, expr: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = _eval(cdp, session, expr)
            if last:
                return last
        except RuntimeError as exc:  # the page is navigating: its context went away; try again
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {expr!r} (last: {last!r})")


def test_page_renders_submits_and_shows_both_gantt_charts(server, browser, tmp_path):
    cdp = browser
    target = cdp.send("Target.createTarget", {"url": server + "/"})["targetId"]
    session = cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    cdp.send("Runtime.enable", session=session)

    # 1. the page renders: form present, no results yet, JS ran (only the preset fields visible)
    _wait_for(cdp, session, "document.readyState === 'complete' && !!document.getElementById('mix-form')")
    assert _eval(cdp, session, "document.title").startswith("flamia_pack")
    assert _eval(cdp, session, "!!document.getElementById('no-results')")
    assert _eval(cdp, session, "document.querySelector('[data-kind=lognormal]').classList.contains('hidden')")
    assert not _eval(cdp, session, "document.querySelector('[data-kind=preset]').classList.contains('hidden')")
    assert _eval(cdp, session, "document.querySelectorAll('#gantt-static svg, #gantt-dynamic svg').length") == 0

    # 2. choose a mix as a user would (change event toggles the fields), then press the button
    _eval(cdp, session, """
        (() => { const k = document.getElementById('mix-kind'); k.value = 'histogram';
                 k.dispatchEvent(new Event('change'));
                 document.getElementById('histogram').value = '8192 x 1\\n256 x 224';
                 return true; })()""")
    assert not _eval(cdp, session, "document.querySelector('[data-kind=histogram]').classList.contains('hidden')")
    _eval(cdp, session, "document.getElementById('submit').click(), true")

    # 3. the answer page: both Gantt charts (and the histogram) as inline SVG with drawn content
    _wait_for(cdp, session, "!!document.querySelector('#gantt-static svg') && !!document.querySelector('#gantt-dynamic svg')")
    for sel in ("#gantt-static svg", "#gantt-dynamic svg", "#plot-lengths svg", "#plot-history svg"):
        box = _eval(cdp, session, f"(() => {{ const r = document.querySelector('{sel}').getBoundingClientRect();"
                                  " return [r.width, r.height]; })()")
        assert box[0] > 200 and box[1] > 100, (sel, box)
    assert _eval(cdp, session, "document.querySelectorAll('#gantt-static svg path, #gantt-static svg image').length") > 10
    summary = _eval(cdp, session, "document.getElementById('summary').innerText")
    assert "225" in summary and "static" in summary and "dynamic" in summary
    assert not _eval(cdp, session, "!!document.getElementById('error')")
    assert _eval(cdp, session, "document.getElementById('histogram').value.trim()") == "8192 x 1\n256 x 224"
    shot = cdp.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
    assert len(shot) > 10_000  # something was painted
    (tmp_path / "page.png.b64").write_text(shot)

    # 4. a bad form shows the reason on the page (422: zero-length documents are refused), still no charts
    _eval(cdp, session, """
        (() => { const k = document.getElementById('mix-kind'); k.value = 'lengths';
                 k.dispatchEvent(new Event('change'));
                 document.getElementById('lengths').value = '0 0 0';
                 document.getElementById('submit').click(); return true; })()""")
    text = _wait_for(cdp, session, "document.getElementById('error') && document.getElementById('error').innerText")
    assert "greater than or equal to 1" in text
    assert _eval(cdp, session, "document.querySelectorAll('#gantt-static svg').length") == 0


def test_docs_render_swagger_ui_from_local_assets(server, browser):
    """/docs shows the API's operations with the assets this server ships (was blank offline: CDN)."""
    cdp = browser
    target = cdp.send("Target.createTarget", {"url": server + "/docs"})["targetId"]
    session = cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    cdp.send("Runtime.enable", session=session)
    _wait_for(cdp, session, "document.querySelectorAll('.opblock').length >= 5")
    paths = _eval(cdp, session, "[...document.querySelectorAll('.opblock-summary-path')].map(e => e.innerText)")
    assert any("cost:predict" in p for p in paths), paths
    assert not _eval(cdp, session, "!!document.querySelector('.errors-wrapper, .version-pragma')")  # spec rendered
    hosts = _eval(cdp, session, "[...new Set(performance.getEntriesByType('resource').map(e => new URL(e.name).host))]")
    assert hosts == [server.split("//", 1)[1]], hosts  # every resource came from this server

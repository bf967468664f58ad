"""`browser.py URL OUT_JSON [--no-js] [--wait-refresh] [--screenshot PNG] [--width W]`:
loads URL in headless Chromium (Debian's `chromium`) and writes what a person would have seen.

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: commands
on its fd 3, answers and events on its fd 4, each message a JSON object ended by NUL), so no
websocket library and no open debugging port are needed. Each run uses a fresh profile in a
temporary directory, removed at the end, and the flags that keep Chromium from reaching out on
its own (background networking, component updates, sync, first-run).

OUT_JSON gets: `fields` (every element with `data-field`: [field, value, unit, text]),
`requests` (every URL the page requested), `responses` (URL, status and headers of each
answer), `console` (console messages of level warning or
error, and uncaught exceptions), `log` (browser log entries of level warning or error: failed
loads, policy violations), `refreshes` (the page's `data-refreshes` when done), `title`.
With --no-js the page's scripts are disabled (DevTools' own evaluation still reads the DOM);
with --wait-refresh, it waits (up to 20 s) until the page's script has refreshed the figures
once after the load. --screenshot saves the whole page as PNG.
"""
import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--metrics-recording-only",
    "--remote-debugging-pipe",
]

EXTRACT = """JSON.stringify({
  title: document.title,
  refreshes: Number(document.body.dataset.refreshes || 0),
  fields: Array.from(document.querySelectorAll("[data-field]")).map(e =>
    [e.dataset.field, e.dataset.value, e.dataset.unit || "", e.textContent.trim()]),
})"""

WAIT_REFRESH = """new Promise((resolve, reject) => {
  const start = Number(document.body.dataset.refreshes || 0);
  const t0 = Date.now();
  const poll = () => {
    if (Number(document.body.dataset.refreshes || 0) > start) { resolve(true); return; }
    if (Date.now() - t0 > 20000) { reject(new Error("no refresh in 20 s")); return; }
    setTimeout(poll, 50);
  };
  poll();
})"""


class Browser:
    def __init__(self, binary, profile):
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()

        def child():
            # Move both ends out of the way first, so neither dup2 clobbers the other.
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            a, b = os.dup2(a, 100), os.dup2(b, 101)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child,
            close_fds=False,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.buf = b""
        self.next_id = 0
        self.events = []

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self.from_chrome, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed its pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, params=None, session=None, timeout=30.0):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method, timeout=30.0):
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            e = self._read_message(deadline)
            if e.get("method") == method:
                return e
            self.events.append(e)

    def close(self):
        try:
            self.send("Browser.close", timeout=5.0)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def evaluate(browser, session, expr, await_promise=False, timeout=30.0):
    result = browser.send(
        "Runtime.evaluate",
        {"expression": expr, "returnByValue": True, "awaitPromise": await_promise},
        session=session,
        timeout=timeout,
    )
    if "exceptionDetails" in result:
        raise RuntimeError(f"evaluation failed: {result['exceptionDetails']}")
    return result["result"].get("value")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--no-js", action="store_true")
    ap.add_argument("--wait-refresh", action="store_true")
    ap.add_argument("--screenshot")
    ap.add_argument("--width", type=int, default=1280)
    args = ap.parse_args()
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if not binary:
        sys.exit("chromium is not installed (`cargo xtask setup` installs Debian's)")
    profile = tempfile.mkdtemp(prefix="skewless-chromium-")
    browser = Browser(binary, profile)
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})
        session = browser.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )["sessionId"]
        for domain in ["Page", "Runtime", "Network", "Log"]:
            browser.send(f"{domain}.enable", session=session)
        browser.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": args.width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        if args.no_js:
            browser.send(
                "Emulation.setScriptExecutionDisabled", {"value": True}, session=session
            )
        browser.send("Page.navigate", {"url": args.url}, session=session)
        browser.wait_event("Page.loadEventFired")
        if args.wait_refresh:
            evaluate(browser, session, WAIT_REFRESH, await_promise=True, timeout=30.0)
        page = json.loads(evaluate(browser, session, EXTRACT))
        if args.screenshot:
            size = browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
            shot = browser.send(
                "Page.captureScreenshot",
                {
                    "format": "png",
                    "captureBeyondViewport": True,
                    "clip": {
                        "x": 0,
                        "y": 0,
                        "width": args.width,
                        "height": size["height"],
                        "scale": 1,
                    },
                },
                session=session,
            )
            with open(args.screenshot, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
        # Let late events (a failed fetch, a policy report) arrive before reading them.
        try:
            browser.send("Runtime.evaluate", {"expression": "1"}, session=session)
        except RuntimeError:
            pass
        requests, responses, console, log = [], [], [], []
        for e in browser.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Network.requestWillBeSent":
                requests.append(params["request"]["url"])
            elif method == "Network.responseReceived":
                r = params["response"]
                headers = {k.lower(): v for k, v in r.get("headers", {}).items()}
                responses.append({"url": r["url"], "status": r["status"], "headers": headers})
            elif method == "Runtime.consoleAPICalled" and params.get("type") in (
                "error",
                "warning",
                "assert",
            ):
                console.append(
                    " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
                )
            elif method == "Runtime.exceptionThrown":
                console.append(json.dumps(params["exceptionDetails"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                entry = params["entry"]
                log.append(f"{entry['source']}: {entry['text']} {entry.get('url', '')}".strip())
        page.update(
            {"requests": requests, "responses": responses, "console": console, "log": log}
        )
        with open(args.out, "w") as f:
            json.dump(page, f, indent=1)
    finally:
        browser.close()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()

"""HTTP client for an external code sandbox speaking the SandboxFusion API (`POST <url>/run_code`).

For runs that outgrow one host's sandbox workers (`rewards.code_sandbox=sandbox_fusion`, URL in
`rewards.code_sandbox_url`). A request is

    {"code": str, "language": "python", "stdin": str, "run_timeout": seconds,
     "compile_timeout": seconds}

and the answer {"status": "Success" | "Failed" | "SandboxError", "message": str,
"run_result": {"status": "Finished" | "TimeLimitExceeded" | ..., "return_code": int,
"stdout": str, "stderr": str, "execution_time": float}}.

A program becomes self-contained scripts (sandbox.remote_scripts): one per stdin/stdout test, one
per program otherwise, each ending in a random marker line printed only when every test of the
script passed (a program that exits early never prints it). Verdicts have the local sandbox's
shape: {"status": "ok" | "timeout" | "error", "passed", "total", "message", "seconds"}.
Requests run `concurrency` at a time from threads; connection failures are retried once and
then reported as "error" (scored 0, counted, not cached).
"""
from __future__ import annotations

import concurrent.futures
import json
import secrets
import time
import urllib.error
import urllib.request
from typing import Sequence

from delta_jax.rl import sandbox as sb


def remote_scripts(program: str, spec: dict) -> list[tuple[str, str, str | None, str]]:
    """(code, stdin, expected stdout or None, marker) per request for one program."""
    kind = spec["kind"]
    if kind == "stdio":
        return [(program, stdin, expected, "") for stdin, expected in
                zip(spec["inputs"], spec["outputs"])]
    marker = secrets.token_hex(12)
    if kind == "function":
        entry = spec["entry_point"]
        if sb._defines(program, entry):
            head = spec["prompt"] + "\n" + program
        else:
            head = spec["prompt"] + program
        code = f"{head}\n\n{spec['test']}\n\ncheck({entry})\nprint({marker!r})\n"
        return [(code, "", None, marker)]
    if kind == "assert":
        return [(f"{spec['setup']}\n{program}\n\n{test}\nprint({marker!r})\n", "", None, marker)
                for test in spec["tests"]]
    # call-based: the comparison inlined, one script per input
    out = []
    for args, expected in zip(spec["inputs"], spec["outputs"]):
        args = args if isinstance(args, list) else [args]
        code = (f"{program}\n\n"
                "import json as _j\n"
                "def _plain(v):\n"
                "    if isinstance(v, (list, tuple)): return [_plain(x) for x in v]\n"
                "    if isinstance(v, dict): return {k: _plain(x) for k, x in v.items()}\n"
                "    return v\n"
                f"_fn = globals().get({spec['fn_name']!r})\n"
                "if _fn is None and isinstance(globals().get('Solution'), type):\n"
                f"    _fn = getattr(Solution(), {spec['fn_name']!r})\n"
                f"_r = _plain(_fn(*_j.loads({json.dumps(args)!r})))\n"
                f"_e = _plain(_j.loads({json.dumps(expected)!r}))\n"
                "assert _r == _e or (isinstance(_e, list) and len(_e) == 1 and _r == _e[0])\n"
                f"print({marker!r})\n")
        out.append((code, "", None, marker))
    return out


class SandboxFusionClient:
    """Runs programs against test specs on a SandboxFusion-compatible server."""

    def __init__(self, url: str, timeout_s: float = 10.0, concurrency: int = 8,
                 request_timeout_s: float | None = None, retries: int = 1):
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"rewards.code_sandbox_url: an http(s) URL of the sandbox service "
                             f"is needed, got {url!r}")
        if concurrency < 1:
            raise ValueError(f"sandbox_fusion concurrency must be >= 1, got {concurrency}")
        self.url = url.rstrip("/") + "/run_code"
        self.timeout_s = float(timeout_s)
        self.request_timeout_s = request_timeout_s or self.timeout_s + 30.0
        self.retries = retries
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="sandbox-fusion")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _post(self, code: str, stdin: str) -> dict:
        body = json.dumps({"code": code, "language": "python", "stdin": stdin,
                           "run_timeout": self.timeout_s, "compile_timeout": self.timeout_s}
                          ).encode()
        last = None
        for _ in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout_s) as resp:
                    return json.loads(resp.read().decode("utf-8", "replace"))
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = e
        raise ConnectionError(f"sandbox_fusion request to {self.url} failed: {last}")

    def _run_one(self, program: str, spec: dict, pass_fraction: bool) -> dict:
        t0 = time.monotonic()
        total = sb.num_tests(spec)
        passed, message = 0, ""
        for i, (code, stdin, expected, marker) in enumerate(remote_scripts(program, spec)):
            try:
                answer = self._post(code, stdin)
            except ConnectionError as e:
                return {"status": sb.ERROR, "passed": passed, "total": total,
                        "message": str(e)[:300], "seconds": time.monotonic() - t0}
            run = answer.get("run_result") or {}
            if answer.get("status") == "SandboxError":
                return {"status": sb.ERROR, "passed": passed, "total": total,
                        "message": f"sandbox error: {answer.get('message', '')}"[:300],
                        "seconds": time.monotonic() - t0}
            if run.get("status") == "TimeLimitExceeded":
                return {"status": sb.TIMEOUT, "passed": passed, "total": total,
                        "message": f"test {i}: time limit", "seconds": time.monotonic() - t0}
            stdout = run.get("stdout") or ""
            finished = run.get("status") == "Finished" and run.get("return_code") == 0
            if expected is not None:
                ok = finished and sb.outputs_match(stdout, expected)
            else:
                ok = finished and stdout.rstrip().endswith(marker)
            if ok:
                passed += 1
            else:
                message = message or f"test {i}: {run.get('status')} " \
                                     f"(return code {run.get('return_code')})"
                if not pass_fraction:
                    break
        if spec["kind"] == "function":
            total = 1
        return {"status": sb.OK, "passed": passed, "total": total, "message": message,
                "seconds": time.monotonic() - t0}

    def run_many(self, programs: Sequence[str], specs: Sequence[dict],
                 pass_fraction: bool = False) -> list[dict]:
        """Verdicts for programs[i] against specs[i] (parsed specs), in order."""
        futures = [self._executor.submit(self._run_one, p, s, pass_fraction)
                   for p, s in zip(programs, specs)]
        return [f.result() for f in futures]

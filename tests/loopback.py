"""Loopback fake servers for the HTTP backends: Gemini generateContent, OpenAI chat completions, Serper.

Each `FakeServer` binds 127.0.0.1 on a free port, speaks its API's wire format, validates every request
(path, auth header, body shape; a violation is answered 4xx and recorded in `errors`) and records it in
`requests`. Replies come from, in order of precedence:
  1. `rule(request) -> action | None`, a per-test function (deterministic under concurrency);
  2. `script`, a FIFO of actions consumed one per request;
  3. the automatic responder, which answers any judge request validly from its schema and prompt
     (the requested ids are in the schema's `enum`) and any search with k made-up results.
Actions (dicts): {"status": 429} an error status; {"drop": True} close the connection unanswered;
{"sleep": s} wait s seconds, then the automatic reply; {"text": "..."} this model text; {"json": obj} this object as model text; {"mutate": fn}
fn(automatic object) as model text; {"body": "..."} this raw HTTP body with status 200. An error
status may carry {"headers": {...}} (e.g. Retry-After), {"message": "..."} (the JSON error message) and
{"details": [...]} (google.rpc details such as RetryInfo).
Closing shuts every open client connection (a handler waiting for the next request on a kept-alive
connection ends at once) and waits for the handler threads, a deliberately slow reply included (at most
its sleep), so no thread of the server outlives its test (tests/conftest.py fails a test that leaves
one).
"""
from __future__ import annotations

import collections
import hashlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TEST_KEY = "sk-TESTKEY-1234567890"
STAGE_CLOSERS = {"plan": "</structured_plan>", "research": "</state_evaluation>",
                 "review": "</review>", "answer": "</answer>"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


class FakeServer:
    """kind: "gemini" | "openai" | "serper". key: the expected API key (None: no auth required).
    usage: (input, output) tokens reported per reply. Use as a context manager."""

    def __init__(self, kind: str, key: str | None = TEST_KEY, model: str = "gemini-test",
                 usage: tuple[int, int] = (100, 20)):
        assert kind in ("gemini", "openai", "serper")
        self.kind, self.key, self.model, self.usage = kind, key, model, usage
        self.script: collections.deque = collections.deque()
        self.rule = None
        self.requests: list[dict] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._conns: dict = {}  # open client socket -> its handler thread; both ended by close()
        self._httpd = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        port = self._httpd.server_address[1]
        root = {"gemini": "/v1beta", "openai": "/v1", "serper": ""}[self.kind]
        return f"http://127.0.0.1:{port}{root}"

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            conns = list(self._conns.items())
        for c, _ in conns:  # a handler blocked reading the next request on a kept-alive connection ends
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)
        for _, th in conns:
            th.join(timeout=10)

    # request handling --------------------------------------------------------------------------
    def _handler(self):
        server = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # keep test output clean
                pass

            def setup(self):
                super().setup()
                with server._lock:
                    server._conns[self.connection] = threading.current_thread()

            def finish(self):
                with server._lock:
                    server._conns.pop(self.connection, None)
                try:
                    super().finish()
                except OSError:  # the connection was shut down by close()
                    pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(n)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                req = {"path": self.path, "headers": dict(self.headers.items()), "body": body}
                with server._lock:
                    server.requests.append(req)
                err = server._validate(req)
                if err:
                    with server._lock:
                        server.errors.append(err)
                    return self._send(400 if "body" in err else 401 if "key" in err else 404,
                                      {"error": {"message": err}})
                action = server.rule(req) if server.rule else None
                if action is None:
                    with server._lock:
                        action = server.script.popleft() if server.script else {}
                if "drop" in action:  # close the connection without a reply
                    self.close_connection = True
                    return
                if "sleep" in action:
                    time.sleep(action["sleep"])
                if "status" in action:
                    err = {"code": action["status"]}
                    if "message" in action:
                        err["message"] = action["message"]
                    if "details" in action:  # google.rpc details (RetryInfo, ErrorInfo)
                        err["details"] = action["details"]
                    return self._send(action["status"], {"error": err}, action.get("headers"))
                if "body" in action:
                    return self._send(200, action["body"])
                if server.kind == "serper":
                    return self._send(200, server._serper_reply(body))
                if "text" in action:
                    text = action["text"]
                else:
                    obj = action["json"] if "json" in action else server._auto(req)
                    if "mutate" in action:
                        obj = action["mutate"](obj)
                    text = json.dumps(obj)
                return self._send(200, server._wrap(text))

            def _send(self, status, payload, headers=None):
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    for k, v in (headers or {}).items():
                        self.send_header(k, str(v))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

        return H

    def _route_error(self, req: dict) -> str:
        """"" when the request's path and key header fit this server's wire format, else why not."""
        h = {k.lower(): v for k, v in req["headers"].items()}
        path, header, value = {
            "gemini": (f"/v1beta/models/{self.model}:generateContent", "x-goog-api-key", self.key),
            "openai": ("/v1/chat/completions", "authorization", f"Bearer {self.key}"),
        }.get(self.kind, ("/search", "x-api-key", self.key))
        if req["path"] != path:
            return f"unknown path {req['path']}"
        if self.key is not None and h.get(header) != value:
            return "bad or missing key"
        return ""

    def _validate(self, req: dict) -> str:
        b = req["body"]
        bad = self._route_error(req)
        if bad:
            return bad
        if self.kind == "gemini":
            try:
                c = b["contents"]
                assert isinstance(c, list) and c[0]["role"] == "user"
                assert isinstance(c[0]["parts"][0]["text"], str)
                assert isinstance(b["systemInstruction"]["parts"][0]["text"], str)
                g = b["generationConfig"]
                assert g["responseMimeType"] == "application/json"
                assert isinstance(g["temperature"], (int, float))
                assert ("responseSchema" in g) != ("responseJsonSchema" in g)
            except (KeyError, IndexError, TypeError, AssertionError):
                return "bad body shape"
        elif self.kind == "openai":
            try:
                assert isinstance(b["model"], str)
                assert [m["role"] for m in b["messages"]] == ["system", "user"]
                f = b["response_format"]
                assert f["type"] in ("json_schema", "json_object")
                if f["type"] == "json_schema":
                    assert isinstance(f["json_schema"]["name"], str) and f["json_schema"]["schema"]
            except (KeyError, IndexError, TypeError, AssertionError):
                return "bad body shape"
        else:
            if not (isinstance(b, dict) and isinstance(b.get("q"), str) and isinstance(b.get("num"), int)):
                return "bad body shape"
        return ""

    # replies ------------------------------------------------------------------------------------
    def _wrap(self, text: str) -> dict:
        tin, tout = self.usage
        if self.kind == "gemini":
            return {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]},
                                    "finishReason": "STOP"}],
                    "usageMetadata": {"promptTokenCount": tin, "candidatesTokenCount": tout,
                                      "totalTokenCount": tin + tout}}
        return {"id": "x", "object": "chat.completion", "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": tin, "completion_tokens": tout, "total_tokens": tin + tout}}

    def _serper_reply(self, body: dict) -> dict:
        q, k = body["q"], body["num"]
        slug = re.sub(r"\W+", "-", q.lower()).strip("-")
        return {"searchParameters": {"q": q}, "organic": [
            {"title": f"Result {j} for {q}", "link": f"https://example.org/{slug}/{j}",
             "snippet": f"Snippet {j} about {q}.", "position": j + 1} for j in range(k)]}

    @staticmethod
    def prompt_and_schema(req: dict) -> tuple[str, dict | None]:
        b = req["body"]
        if "contents" in b:
            g = b["generationConfig"]
            schema = g.get("responseSchema") or g.get("responseJsonSchema")
            return b["contents"][0]["parts"][0]["text"], schema
        f = b["response_format"]
        return b["messages"][-1]["content"], f.get("json_schema", {}).get("schema")

    def _auto(self, req: dict) -> dict:
        """A valid, content-aware reply: a stage block scores 1 if it closes its tag, 0.5 if it is
        non-empty, 0 otherwise (varied slightly per rubric); reflections by length."""
        prompt, schema = self.prompt_and_schema(req)
        props = schema["properties"]
        if "rubrics" in props:
            return {"rubrics": [{"stage": s, "title": f"{s} check {j}",
                                 "description": f"Fake criterion {j} for the {s} stage.", "weight": 1}
                                for s in STAGE_CLOSERS for j in range(4)]}
        item = props["scores"]["items"]["properties"]
        if "rubric_id" in item:
            out = []
            for rid in item["rubric_id"]["enum"]:
                stage = rid.split(":")[1] if rid.startswith("llm:") else "answer"
                m = re.search(rf'<untrusted id="response/{stage}">\n(.*?)\n</untrusted>', prompt, re.S)
                block = m.group(1) if m else ""
                base = 1.0 if STAGE_CLOSERS[stage] in block else 0.5 if block.strip() else 0.0
                jitter = int(hashlib.sha1(rid.encode()).hexdigest()[:4], 16) % 3
                out.append({"rubric_id": rid, "justification": f"{stage} block checked",
                            "score": base * (1 - 0.1 * jitter)})
            return {"scores": out}
        out = []
        for cid in item["candidate_id"]["enum"]:
            m = re.search(rf'<untrusted id="{cid}">\n(.*?)\n</untrusted>', prompt, re.S)
            n = len(m.group(1)) if m else 0
            out.append({"candidate_id": cid, "justification": "by length",
                        "within": min(1.0, n / 100), "cross": 0.5})
        return {"scores": out}


class FakeProxy:
    """A forwarding HTTP proxy on 127.0.0.1 for plain-http targets: it receives the absolute-URI
    request a client sends to a proxy (`POST http://127.0.0.1:PORT/path`), records the URL in
    `seen`, forwards the request to the target and relays the answer. Use as a context manager;
    `url` goes into HTTP_PROXY / HTTPS_PROXY."""

    def __init__(self):
        self.seen: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                import http.client
                import urllib.parse

                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with proxy._lock:
                    proxy.seen.append(self.path)
                u = urllib.parse.urlsplit(self.path)
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
                hdrs = {k: v for k, v in self.headers.items()
                        if k.lower() not in ("proxy-connection", "connection", "host")}
                conn.request("POST", u.path + (f"?{u.query}" if u.query else ""), raw, hdrs)
                r = conn.getresponse()
                body = r.read()
                conn.close()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = _Server(("127.0.0.1", 0), H)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "FakeProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2)


def serve(url_file: str) -> None:
    """Run a Gemini and a Serper fake server (key TEST_KEY) until killed; write their URLs to url_file
    as JSON {"gemini": ..., "serper": ...} once they listen (scripts/gpu_smoke.sh uses this)."""
    import os
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait below
    with FakeServer("gemini", model="gemini-test") as gj, FakeServer("serper") as ss:
        tmp = url_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"gemini": gj.url, "serper": ss.url, "key": TEST_KEY}, fh)
        os.replace(tmp, url_file)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
        print(f"loopback: {len(gj.requests)} judge requests ({len(gj.errors)} rejected), "
              f"{len(ss.requests)} search requests ({len(ss.errors)} rejected)", flush=True)


def schema_reply(req: dict) -> dict:
    """A reply action for any benchmark grader request (evaluate.py) built from the request's schema:
    response_format.json_schema when given, else the JSON Schema the prompt states (json_object
    mode). Values are deterministic in the prompt (a hash), so verdicts differ across items: booleans,
    numbers in [0, 10], the enum value picked by the hash; arrays get one entry per numbered prompt
    line ("1. ...")."""
    prompt = req["body"]["messages"][-1]["content"]
    schema = (req["body"]["response_format"].get("json_schema") or {}).get("schema")
    if schema is None:
        m = re.search(r"JSON Schema \(use exactly these key names\):\n(\{.*\})\n", prompt)
        if m is None:
            return {"text": "I cannot tell which format you want."}
        schema = json.loads(m.group(1))
    h = int(hashlib.sha1(prompt.encode()).hexdigest()[:8], 16)
    n_items = len(re.findall(r"^\d+\. ", prompt, re.M)) or 1

    def fill(sc, salt):
        v = (h >> (salt % 24)) + salt
        if "enum" in sc:
            return sc["enum"][v % len(sc["enum"])]
        t = sc.get("type")
        if t == "object":
            return {k: fill(x, salt + i + 1) for i, (k, x) in enumerate(sc["properties"].items())}
        if t == "array":
            return [fill(sc["items"], salt + 7 * i) for i in range(n_items)]
        return {"string": "checked against the text", "number": v % 11, "boolean": v % 3 != 0}.get(t)

    return {"json": fill(schema, 0)}


def serve_openai(url_file: str) -> None:
    """Run an OpenAI-compatible grader server (no key; replies from `schema_reply`, 120 input and
    40 output tokens each) until killed; write {"openai": url} to url_file once it listens."""
    import os
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    with FakeServer("openai", key=None, model="local-grader", usage=(120, 40)) as s:
        s.rule = schema_reply
        with open(url_file + ".tmp", "w") as fh:
            json.dump({"openai": s.url}, fh)
        os.replace(url_file + ".tmp", url_file)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
        print(f"loopback: {len(s.requests)} grader requests ({len(s.errors)} rejected)", flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "--openai":
        serve_openai(sys.argv[2])
    else:
        serve(sys.argv[1])

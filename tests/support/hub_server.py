"""A small HTTP server speaking the part of the Hugging Face Hub API that ``huggingface_hub`` uses to list and
download files (``repo_info``, ``list_repo_tree``, ``resolve``), serving in-memory files: ``mpitp prefetch`` is tested
against it with ``HF_ENDPOINT`` pointing here, never by patching ``huggingface_hub``.

Also served: Spaces (``/spaces/<org>/<name>/resolve/<rev>/<file>``: where ``evaluate.load`` fetches a metric's script,
``evaluate-metric/<name>``), and, as an HTTP forward proxy (``http_proxy`` pointing here), whole URLs of other hosts
(``web``): nltk's downloader refuses loopback addresses (its SSRF guard) but fetches through a proxy it is told to
trust, as on a login node behind a site proxy."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FakeHub:
    """``repos[(kind, repo_id)] = {path: bytes}`` with kind ``model``, ``dataset`` or ``space``; one revision per repo
    (any revision name is answered with it); ``web[url] = bytes`` answered as a proxy; ``requests`` logs what was
    asked."""

    def __init__(self):
        self.repos: dict[tuple[str, str], dict[str, bytes]] = {}
        self.web: dict[str, bytes] = {}
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, obj):
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _serve(self, head: bool):
                hub.requests.append(f"{self.command} {self.path}")
                if urlsplit(self.path).netloc:  # a proxy request: the whole URL
                    body = hub.web.get(self.path)
                    return self._send(404, b"", {}, head) if body is None else self._send(200, body, {}, head)
                segs = [unquote(s) for s in urlsplit(self.path).path.split("/")[1:]]
                if segs[:1] == ["api"] and len(segs) >= 4:  # /api/{kind}s/{org}/{name}/(revision|tree)/{rev}/...
                    kind, repo, rest = segs[1].rstrip("s"), "/".join(segs[2:4]), segs[4:]
                    files = hub.repos.get((kind, repo))
                    if files is None:
                        return self._send(404, b'{"error": "Repository not found"}',
                                          {"X-Error-Code": "RepoNotFound"})
                    if not rest or rest[0] == "revision":
                        return self._json({"id": repo, "sha": hub.commit(repo), "private": False,
                                           "siblings": [{"rfilename": p} for p in sorted(files)]})
                    if rest[0] == "tree":
                        under = "/".join(rest[2:])
                        return self._json([{"type": "file", "path": p, "size": len(b),
                                            "oid": hashlib.sha1(b).hexdigest()}
                                           for p, b in sorted(files.items())
                                           if not under or p.startswith(under.rstrip("/") + "/")])
                    return self._send(404)
                kind = {"datasets": "dataset", "spaces": "space"}.get(segs[0] if segs else "", "model")
                segs = segs[1:] if kind != "model" else segs
                if len(segs) >= 5 and segs[2] == "resolve":  # /[datasets/]{org}/{name}/resolve/{rev}/{path}
                    repo, path = "/".join(segs[:2]), "/".join(segs[4:])
                    body = hub.repos.get((kind, repo), {}).get(path)
                    if body is None:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    return self._send(200, body, {"X-Repo-Commit": hub.commit(repo),
                                                  "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}, head)
                return self._send(404, b"", {}, head)

        return Handler

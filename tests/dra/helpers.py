"""A minimal real HTTP API serving resource.k8s.io/v1 ResourceClaims (GET one), plus its kubeconfig."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from libs.dra import DRIVER_NAME, claim_path


class ClaimApi:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict] = {}
        self.paths: dict[str, tuple[str, str]] = {}  # URL path -> (namespace, name)
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as an API server: one connection per client
            disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall

            def do_GET(self) -> None:
                obj = api.claims.get(api.paths.get(self.path.split("?")[0], ("", "")))
                if obj is not None:
                    body = json.dumps(obj).encode()
                    self.send_response(200)
                else:
                    body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "reason": "NotFound", "code": 404, "message": "not found"}).encode()
                    self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ClaimApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> str:
        port = self.server.server_address[1]
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "t", "user": {}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t", "namespace": "default"}}],
        }))
        return str(path)

    def put(self, ns: str, name: str, uid: str, *, node: str, devices: list[tuple[str, int, int]],
            pods: list[tuple[str, str]]) -> None:
        """devices: (device name, cores, memory bytes); pods: (name, uid) in reservedFor."""
        results = [{"request": "gpu", "driver": DRIVER_NAME, "pool": node, "device": dev, "shareID": f"s-{uid}-{i}",
                    "consumedCapacity": {"cores": str(cores), "memory": str(mem)}}
                   for i, (dev, cores, mem) in enumerate(devices)]
        self.paths[claim_path(ns, name)] = (ns, name)
        self.claims[(ns, name)] = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns, "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results}},
                       "reservedFor": [{"resource": "pods", "name": p, "uid": u} for p, u in pods]},
        }

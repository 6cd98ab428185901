"""A real S3 API on loopback for the bundle-shipping tests: moto's server, in a thread of the test process.

Its buckets live in moto's in-process backend, so stopping the listener and starting another on the same port is
"the store went down and came back" with the bucket and what was uploaded intact.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from contextlib import closing
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

# moto accepts any key; these keep the cloud SDK's own look-ups (files, instance metadata) out of the tests.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "memwatch-test", "AWS_SECRET_ACCESS_KEY": "memwatch-test",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
               "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    """A loopback port nothing listens on (the tests' "store is down" address until a server takes it)."""
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 on host:port (loopback unless told; a container reaches a bridge's gateway address), started and
    stopped within bounded waits."""

    def __init__(self, port: int, host: str = "127.0.0.1", wrap: Callable[[Any], Any] | None = None) -> None:
        self.port, self.host = port, host
        self.wrap = wrap
        """Wraps moto's WSGI application (a fault of the test's in front of the real store)."""
        self.endpoint = f"http://{host}:{port}"
        self._server = None
        self._thread: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        """The environment a client (obstore, the sidecar) needs to reach this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> S3Server:
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(self.host, self.port, app if self.wrap is None else self.wrap(app), True,
                                   request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="moto-s3", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(timeout=5)
            self._server = None

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="memwatch-test",
                            aws_secret_access_key="memwatch-test", region_name="us-east-1")

    def keys(self, bucket: str) -> list[str]:
        """Every key in the bucket, sorted (read with boto3, a second client beside obstore)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

"""A real S3 API for the tests: moto's server in a process of its own, reached over HTTP by the
real clients (s3fs, boto3), through a proxy the tests steer: it counts each object's downloads,
can cut one download half-way, and can play unreachable.

    with ObjectStore() as store:         # store.env: the credentials and endpoint, as a user sets them
        store.cut_next("text/train-00001.bin")
        store.down = True                # every connection closed at once, as a store gone
"""

import http.client
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
from collections import Counter

SECRET = "test-secret-key-never-printed"  # the tests look for it in every output


class ObjectStore:
    def __init__(self):
        self.downloads = Counter()  # key -> GETs of it
        self.cuts = set()
        self.down = False
        self.port = None  # moto's, once started

    @property
    def env(self):
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.server_address[1]}",
        }

    def cut_next(self, key):
        self.cuts.add(key)

    def __enter__(self):
        # Port 0: the server binds a free port itself and prints it (a port chosen here and bound
        # there could be taken meanwhile by another test's process).
        self.server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        started = threading.Event()

        def read_log():  # the port, then the request log drained for good (a full pipe would stall the server)
            for line in self.server.stderr:
                found = re.search(r"Running on http://127\.0\.0\.1:(\d+)", line)
                if found and not started.is_set():
                    self.port = int(found.group(1))
                    started.set()

        threading.Thread(target=read_log, daemon=True).start()
        assert started.wait(120), "moto's server did not start"
        self.proxy = Proxy(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.proxy.shutdown()
        self.server.kill()
        self.server.wait()

    def client(self):
        import boto3  # noqa: PLC0415

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", **_credentials(self.env))


def _credentials(env):
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


class Proxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that hung up (a run killed mid-download): nothing to report


def _handler(store):
    class Forward(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def forward(self):
            if store.down:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            upstream = http.client.HTTPConnection("127.0.0.1", store.port, timeout=60)
            upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
            response = upstream.getresponse()
            data = response.read()
            key = self.path.split("?")[0].lstrip("/").split("/", 1)[-1]
            if self.command == "GET" and response.status in (200, 206):
                store.downloads[key] += 1
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "server", "date", "content-length"):
                    self.send_header(name, value)
            # The body as read (a chunked one whole): its length, or the client waits for more.
            length = response.getheader("Content-Length") if self.command == "HEAD" else len(data)
            self.send_header("Content-Length", str(length or 0))
            self.end_headers()
            if self.command == "GET" and key in store.cuts:  # half the body, then the connection drops
                store.cuts.discard(key)
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if self.command != "HEAD":
                self.wfile.write(data)
            upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

    return Forward


def without_credentials(env):
    """The environment of a user with no credentials anywhere the AWS clients look."""
    env = {key: value for key, value in env.items() if key not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    missing = os.devnull
    return {
        **env,
        "AWS_SHARED_CREDENTIALS_FILE": missing,
        "AWS_CONFIG_FILE": missing,
        "AWS_EC2_METADATA_DISABLED": "true",
    }

"""A download mirror on 127.0.0.1 for the tests (http.server in a thread): it serves the files
it is given, counts the requests for each, and misbehaves on purpose where asked. No test
contacts a public host (tests/conftest.py turns the real mirrors off for the whole session)."""
import gzip
import hashlib
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np


class Mirror:
    """`with Mirror({name: bytes}) as mirror:` serves each file at mirror.url + name.

    drop: names whose body stops half-way (the full Content-Length announced, then the
    connection closed); slow_s: a pause between 64 KiB chunks (downloads that overlap)."""

    def __init__(self, files, drop=(), slow_s=0.0):
        self.files, self.drop, self.slow_s = dict(files), set(drop), slow_s
        self.requests = Counter()
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                mirror.requests[name] += 1
                body = mirror.files.get(name)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if name in mirror.drop:
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                for start in range(0, len(body), 1 << 16):
                    self.wfile.write(body[start:start + (1 << 16)])
                    time.sleep(mirror.slow_s)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/mnist/"
        # shutdown() waits for the serving loop's next poll: a short one ends each test at once
        # (the default half second was most of a download test's time)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def refused_url():
    """A base URL on 127.0.0.1 where nothing listens: an offline machine, without a network."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/mnist/"


def idx_gz(array, mtime=0):
    """An IDX file (gzipped) holding `array` (uint8): what MNIST's files are."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">i4").tobytes()
    return gzip.compress(header + array.tobytes(), mtime=mtime)


def md5(data):
    return hashlib.md5(data).hexdigest()

"""Requests to the test servers (127.0.0.1 only): the model's name and key, raw HTTP that never raises for a
status, the metrics, and /health probed while something else runs."""

import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np

MODEL = "tiny-2-layer-random"
KEY = "test-key"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


def post(url, path, body, key=KEY, raw=None):
    """(status, parsed JSON or text) of a raw POST; never raises for an HTTP status."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def connect(url, timeout=60) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def ids(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def metric(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def complete(client, prompt, **kw):
    kw.setdefault("extra_body", {}).setdefault("ignore_eos", True)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


@contextlib.contextmanager
def probing_health(url, period=0.05):
    """Probe /health every `period` seconds on a thread while the block runs; yields the (status, seconds) of
    each probe (a status of None: no answer within 5 s)."""
    probes, stop = [], threading.Event()

    def probe():
        while not stop.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    status = r.status
            except OSError:
                status = None
            probes.append((status, time.monotonic() - start))
            stop.wait(period)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        yield probes
    finally:
        stop.set()
        thread.join(10)


def assert_health_answered(probes, within=1.0):
    assert probes and all(status == 200 and seconds < within for status, seconds in probes), probes


def health_during(url, requests):
    """The /health probes taken while the `requests` (callables) run, each on its own thread."""
    with probing_health(url) as probes:
        threads = [threading.Thread(target=request) for request in requests]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    return probes


def slowed(fn, seconds=1.5):
    """fn, holding the thread that calls it `seconds` first (as a tokenizer or decoder would on a large input)."""
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return slow

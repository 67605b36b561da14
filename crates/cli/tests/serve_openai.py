"""Client side of crates/cli/tests/serve.rs: drives `npuc serve` with the official `openai`
client (and raw HTTP where the client cannot express the request) and checks every answer.

Usage: serve_openai.py MODE BASE_URL REFS.json
  MODE api:  chat + completions, streaming and not, stop strings, seeds, logprobs, bad input
  MODE load: 64 streaming requests from 8 concurrent clients, each compared with its reference
  MODE busy: (server started with --parallel 1 --queue 1) 503 when the queue is full, and a
             disconnecting client cancels its generation
REFS.json: {"model": ID, "ctx": N, "completion": [REF...], "chat": [REF...]}, REF = {"prompt",
"max_tokens", "text", "tokens", "prompt_tokens", "stopped"} from `npuc generate --temperature 0 --json`.
Exits non-zero with a message on the first failed check; prints one JSON summary line at the end.
"""

import http.client
import json
import math
import sys
import threading
import time
import urllib.parse

import openai

MODE, BASE, REFS = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
MODEL = REFS["model"]
URL = urllib.parse.urlparse(BASE)
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=600)


def check(cond, msg):
    if not cond:
        raise SystemExit(f"FAILED: {msg}")


def finish_of(ref):
    # npuc generate's stop reasons as OpenAI's finish_reason
    return {"eog": "stop", "stop_string": "stop", "max_tokens": "length"}[ref["stopped"]]


def raw(method, path, body=None, headers=None):
    """One request on its own connection; returns (status, body bytes)."""
    c = http.client.HTTPConnection(URL.hostname, URL.port, timeout=600)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def metrics():
    status, body = raw("GET", "/metrics")
    check(status == 200, f"/metrics answered {status}")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def expect_400(what, body, needle, path="/v1/chat/completions"):
    status, data = raw("POST", path, body=body, headers={"Content-Type": "application/json"})
    check(status == 400, f"{what}: status {status}, expected 400 ({data[:200]!r})")
    err = json.loads(data)["error"]
    check(err["type"] == "invalid_request_error", f"{what}: error type {err['type']}")
    check(needle in err["message"], f"{what}: message {err['message']!r} does not mention {needle!r}")


def stream_text(stream, chat):
    """Concatenated text, finish_reason, usage and ids of a streamed response."""
    text, finish, usage, ids = "", None, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = ch.delta.content if chat else ch.text
            text += piece or ""
            if ch.finish_reason is not None:
                finish = ch.finish_reason
    return text, finish, usage, ids


def api():
    models = client.models.list()
    check([m.id for m in models.data] == [MODEL], f"/v1/models lists {[m.id for m in models.data]}")

    # Greedy completions and chats equal `npuc generate`'s, streamed or not.
    for ref in REFS["completion"]:
        r = client.completions.create(model=MODEL, prompt=ref["prompt"], max_tokens=ref["max_tokens"], temperature=0)
        ch = r.choices[0]
        check(ch.text == ref["text"], f"completion {ref['prompt']!r}: {ch.text!r} != npuc generate's {ref['text']!r}")
        check(ch.finish_reason == finish_of(ref), f"completion finish_reason {ch.finish_reason}, ref {ref['stopped']}")
        check(r.usage.prompt_tokens == ref["prompt_tokens"], f"usage.prompt_tokens {r.usage.prompt_tokens} != {ref['prompt_tokens']}")
        check(r.usage.completion_tokens == ref["tokens"], f"usage.completion_tokens {r.usage.completion_tokens} != {ref['tokens']}")
        check(r.usage.total_tokens == ref["tokens"] + ref["prompt_tokens"], "usage.total_tokens")
        s = client.completions.create(model=MODEL, prompt=ref["prompt"], max_tokens=ref["max_tokens"], temperature=0,
                                      stream=True, stream_options={"include_usage": True})
        text, finish, usage, ids = stream_text(s, chat=False)
        check(text == ref["text"], f"streamed completion {text!r} != {ref['text']!r}")
        check(finish == finish_of(ref), f"streamed completion finish_reason {finish}")
        check(usage is not None and usage.completion_tokens == ref["tokens"], f"streamed usage {usage}")
        check(len(ids) == 1, f"one id per streamed response, got {ids}")
    for ref in REFS["chat"]:
        msgs = [{"role": "user", "content": ref["prompt"]}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=ref["max_tokens"], temperature=0)
        ch = r.choices[0]
        check(ch.message.role == "assistant", f"chat role {ch.message.role}")
        check(ch.message.content == ref["text"], f"chat {ref['prompt']!r}: {ch.message.content!r} != {ref['text']!r}")
        check(ch.finish_reason == finish_of(ref), f"chat finish_reason {ch.finish_reason}, ref {ref['stopped']}")
        check(r.usage.prompt_tokens == ref["prompt_tokens"], f"chat usage.prompt_tokens {r.usage.prompt_tokens}")
        check(r.usage.completion_tokens == ref["tokens"], f"chat usage.completion_tokens {r.usage.completion_tokens}")
        s = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=ref["max_tokens"], temperature=0, stream=True)
        text, finish, _, _ = stream_text(s, chat=True)
        check(text == ref["text"], f"streamed chat {text!r} != {ref['text']!r}")
        check(finish == finish_of(ref), f"streamed chat finish_reason {finish}")

    # Stop strings: the text ends right before the first occurrence, finish_reason "stop".
    ref = max(REFS["completion"], key=lambda r: len(r["text"]))
    words = ref["text"].split()
    check(len(words) >= 6, f"reference too short for a stop-string test: {ref['text']!r}")
    stop = " " + words[len(words) // 2]
    want = ref["text"][: ref["text"].find(stop)]
    for stream in (False, True):
        args = dict(model=MODEL, prompt=ref["prompt"], max_tokens=ref["max_tokens"], temperature=0, stop=[stop, "\u00a7never\u00a7"])
        if stream:
            text, finish, _, _ = stream_text(client.completions.create(stream=True, **args), chat=False)
        else:
            ch = client.completions.create(**args).choices[0]
            text, finish = ch.text, ch.finish_reason
        check(text == want, f"stop {stop!r} (stream={stream}): {text!r}, expected {want!r}")
        check(finish == "stop", f"stop string: finish_reason {finish}")

    # Seeds: the same seed gives the same sample; different seeds give different ones.
    prompt = REFS["completion"][0]["prompt"]
    sample = lambda seed: client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=1.0, seed=seed).choices[0].text
    a, b = sample(42), sample(42)
    check(a == b, f"seed 42 twice: {a!r} != {b!r}")
    others = {sample(s) for s in (1, 2, 3, 4)}
    check(len(others | {a}) > 1, f"seeds 42, 1..4 all gave {a!r}")
    sa = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=1.0, seed=42, stream=True), chat=False)[0]
    check(sa == a, f"seed 42 streamed {sa!r} != {a!r}")

    # Logprobs (chat): greedy picks the most likely token; top_logprobs sorted, a distribution.
    ref = REFS["chat"][0]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ref["prompt"]}],
                                       max_tokens=ref["max_tokens"], temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    check(len(content) == ref["tokens"] - (1 if ref["stopped"] == "eog" else 0),
          f"{len(content)} logprob entries for {ref['tokens']} tokens (stopped: {ref['stopped']})")
    check("".join(c.token for c in content) == r.choices[0].message.content, "logprob tokens do not spell the text")
    for c in content:
        tops = c.top_logprobs
        check(len(tops) == 3, f"{len(tops)} top_logprobs, asked 3")
        check(tops[0].token == c.token and abs(tops[0].logprob - c.logprob) < 1e-6,
              f"greedy token {c.token!r} ({c.logprob}) is not the most likely {tops[0].token!r} ({tops[0].logprob})")
        check(all(x.logprob >= y.logprob for x, y in zip(tops, tops[1:])), "top_logprobs not sorted")
        check(c.logprob <= 0 and sum(math.exp(t.logprob) for t in tops) <= 1 + 1e-4, f"not log-probabilities: {tops}")
        check(bytes(c.bytes) == c.token.encode(), f"bytes of {c.token!r}")
    # Logprobs (completions, streamed): the legacy shape, one entry per token.
    ref = REFS["completion"][0]
    toks, lps = [], []
    for chunk in client.completions.create(model=MODEL, prompt=ref["prompt"], max_tokens=ref["max_tokens"], temperature=0, logprobs=2, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            toks += lp.tokens
            lps += lp.token_logprobs
            check(all(len(t) == 2 for t in lp.top_logprobs), f"top_logprobs {lp.top_logprobs}")
    check("".join(toks) == ref["text"], f"streamed logprob tokens {toks} do not spell {ref['text']!r}")
    check(all(x <= 0 for x in lps), f"token_logprobs {lps}")

    # Bad input: 400 in OpenAI's shape, with the reason; the server keeps serving.
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
        check(False, "n=2 was accepted")
    except openai.BadRequestError as e:
        check("n = 2" in str(e), f"n=2: {e}")
    try:
        client.completions.create(model="no-such-model", prompt="hi")
        check(False, "an unknown model was accepted")
    except openai.BadRequestError as e:
        check("unknown model 'no-such-model'" in str(e), f"unknown model: {e}")
    expect_400("malformed JSON", b'{"messages": [', "not valid JSON")
    expect_400("missing messages", json.dumps({"model": MODEL}).encode(), "'messages' is required")
    expect_400("messages of the wrong type", json.dumps({"messages": "hi"}).encode(), "does not have the fields and types")
    expect_400("missing prompt", json.dumps({"model": MODEL}).encode(), "'prompt' is required", "/v1/completions")
    long_prompt = "hello " * (REFS["ctx"] + 10)
    expect_400("prompt longer than ctx", json.dumps({"prompt": long_prompt}).encode(), "more than the context", "/v1/completions")
    expect_400("token id out of range", json.dumps({"prompt": [10**9]}).encode(), "outside the vocabulary", "/v1/completions")
    expect_400("negative temperature", json.dumps({"prompt": "hi", "temperature": -1}).encode(), "'temperature'", "/v1/completions")
    status, data = raw("GET", "/nope")
    check(status == 404 and b"no route /nope" in data, f"unknown route: {status} {data!r}")
    status, data = raw("GET", "/health")
    check(status == 200 and json.loads(data)["status"] == "ok", f"/health after bad input: {status} {data!r}")
    m = metrics()
    check(m.get('npuc_requests_total{endpoint="/v1/chat/completions",status="400"}', 0) >= 3, "400s not counted in /metrics")
    check(m["npuc_generated_tokens_total"] > 0 and m["npuc_prompt_tokens_total"] > 0, "token counters")
    check(m["npuc_active_sessions"] == 0 and m["npuc_queue_depth"] == 0, f"idle server: {m}")
    print(json.dumps({"api": "ok", "generated_tokens": m["npuc_generated_tokens_total"]}))


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


def load():
    refs = REFS["completion"] + REFS["chat"]
    n_requests, n_clients = 64, 8
    jobs = list(range(n_requests))
    lock = threading.Lock()
    results, errors = {}, []

    def one(i):
        # Request i: reference i mod len(refs); concurrent requests have different prompts.
        ref_i = i % len(refs)
        ref = refs[ref_i]
        chat = ref_i >= len(REFS["completion"])
        t0 = time.perf_counter()
        first = None
        text, finish, ids = "", None, set()
        if chat:
            s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ref["prompt"]}],
                                               max_tokens=ref["max_tokens"], temperature=0, stream=True)
        else:
            s = client.completions.create(model=MODEL, prompt=ref["prompt"], max_tokens=ref["max_tokens"], temperature=0, stream=True)
        for chunk in s:
            ids.add(chunk.id)
            for ch in chunk.choices:
                piece = (ch.delta.content if chat else ch.text) or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
                if ch.finish_reason is not None:
                    finish = ch.finish_reason
        total = time.perf_counter() - t0
        return ref, text, finish, ids, first, total

    def client_thread():
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop(0)
            try:
                results[i] = one(i)
            except Exception as e:  # recorded, the check below fails with it
                with lock:
                    errors.append(f"request {i}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_thread) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    check(not errors, f"{len(errors)} errors: {errors[:3]}")
    check(len(results) == n_requests, f"{len(results)} of {n_requests} requests answered")
    all_ids = set()
    for i, (ref, text, finish, ids, _, _) in sorted(results.items()):
        check(text == ref["text"], f"request {i} ({ref['prompt']!r}): {text!r} != reference {ref['text']!r}")
        check(finish == finish_of(ref), f"request {i}: finish_reason {finish}, reference {ref['stopped']}")
        check(len(ids) == 1 and not (ids & all_ids), f"request {i}: response ids {ids} not its own")
        all_ids |= ids
    lat = [r[5] for r in results.values()]
    ttft = [r[4] for r in results.values() if r[4] is not None]
    m = metrics()
    summary = {
        "requests": n_requests, "clients": n_clients, "errors": len(errors), "wall_s": round(wall, 2),
        "latency_s": {p: round(percentile(lat, int(p[1:])), 3) for p in ("p50", "p90", "p99")},
        "ttft_s": {p: round(percentile(ttft, int(p[1:])), 3) for p in ("p50", "p90", "p99")},
        "generated_tokens": m["npuc_generated_tokens_total"],
        "tokens_per_s": round(m["npuc_generated_tokens_total"] / wall, 1),
    }
    print(json.dumps(summary))


def wait_cancelled(before, n, what):
    """Waits (30 s at most) until `n` more generations were cancelled and no session is active."""
    deadline = time.time() + 30
    while True:
        m = metrics()
        if m["npuc_cancelled_total"] - before["npuc_cancelled_total"] == n and m["npuc_active_sessions"] == 0:
            return m
        check(time.time() < deadline, f"{what}: not cancelled within 30 s: {m}")
        time.sleep(0.05)


def busy():
    """Server with --parallel 1 --queue 1."""
    before = metrics()

    def start_stream(body):
        c = http.client.HTTPConnection(URL.hostname, URL.port, timeout=600)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        return c, c.getresponse()

    # A counting prompt keeps the model going for all of max_tokens.
    long = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 400, "temperature": 0, "stream": True}
    conn_a, resp_a = start_stream(long)
    check(resp_a.status == 200, f"A: status {resp_a.status}")
    line = resp_a.readline()
    check(line.startswith(b"data: {"), f"A's first line {line!r}")
    conn_b, resp_b = start_stream(long)
    check(resp_b.status == 200, f"B: status {resp_b.status}")
    deadline = time.time() + 30
    while metrics()["npuc_queue_depth"] != 1:
        check(time.time() < deadline, "B never showed in npuc_queue_depth")
        time.sleep(0.05)
    # Session busy, queue full: C is refused at once.
    status, data = raw("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 4}).encode())
    check(status == 503, f"C with a full queue: status {status}, expected 503")
    err = json.loads(data)["error"]
    check("busy" in err["message"] and err["type"] == "server_busy", f"503 body {err}")
    try:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        check(False, "the openai client got an answer from a full server")
    except openai.InternalServerError as e:
        check(e.status_code == 503, f"openai client: {e}")
    # Disconnect both mid-generation: A stops generating (it would otherwise run to 400 tokens),
    # B never starts; the session is free again.
    time.sleep(1.0)
    conn_b.close()
    conn_a.close()
    t_close = time.time()
    m = wait_cancelled(before, 2, "two disconnected streaming requests")
    cancel_s = time.time() - t_close
    generated = m["npuc_generated_tokens_total"] - before["npuc_generated_tokens_total"]
    check(generated < 400, f"{generated} tokens generated for two requests cancelled early (of 2 x 400 asked)")
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0)
    check(r.choices[0].finish_reason in ("stop", "length"), "the freed session answers")
    # A non-streaming request whose client goes away is cancelled too.
    before = metrics()
    conn = http.client.HTTPConnection(URL.hostname, URL.port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps({**long, "stream": False}), headers={"Content-Type": "application/json"})
    deadline = time.time() + 30
    while metrics()["npuc_active_sessions"] != 1:
        check(time.time() < deadline, "the non-streaming request never started")
        time.sleep(0.05)
    time.sleep(0.5)
    conn.close()
    m = wait_cancelled(before, 1, "a disconnected non-streaming request")
    check(m["npuc_generated_tokens_total"] - before["npuc_generated_tokens_total"] < 400, "the non-streaming request ran on")
    print(json.dumps({"busy": "ok", "tokens_of_cancelled": generated, "cancelled_within_s": round(cancel_s, 3)}))


{"api": api, "load": load, "busy": busy}[MODE]()

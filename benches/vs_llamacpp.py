"""Driver of benches/vs_llamacpp.sh: alternating llama-bench / npuc bench runs, medians, ratios."""
import argparse, json, os, resource, statistics, subprocess, sys

MODELS = {
    "gemma3-270m": "gemma3-270m/gemma-3-270m-q4_k_m.gguf",
    "smollm2-135m": "smollm2-135m/smollm2-135m-instruct-q4_1.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}


WRAP = ("import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:])\n"
        "sys.stderr.write('\\nPEAK_RSS_KB %d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(p.returncode)\n")


def run(cmd, env=None):
    """Runs cmd in a fresh wrapper process; returns (stdout, the command's peak RSS in bytes)."""
    p = subprocess.run([sys.executable, "-c", WRAP, *cmd], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    rss = [int(l.split()[1]) * 1024 for l in p.stderr.splitlines() if l.startswith("PEAK_RSS_KB ")]
    return p.stdout, rss[-1] if rss else None


def llama(binary, model, threads):
    env = dict(os.environ, LD_LIBRARY_PATH=binary)
    out, rss = run([f"{binary}/llama-bench", "-m", model, "-t", str(threads), "-p", "128,512",
                    "-n", "64", "-r", "1", "-o", "json"], env)
    res = {}
    for r in json.loads(out):
        key = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        res[key] = r["avg_ts"]
    return res, rss


def npuc(binary, model, threads):
    res, rss_max = {}, None
    for plen, gen in ((128, 64), (512, 0)):
        out, rss = run([binary, "bench", model, "--threads", str(threads), "--prompt-len", str(plen),
                      "--gen", str(gen), "--runs", "1", "--json"])
        j = json.loads(out)
        res[f"pp{plen}"] = j["prefill_tokens_per_s"]
        if gen:
            res["tg64"] = j["decode_tokens_per_s"]
            for k in ("weight_bytes_per_token", "read_bandwidth_bytes_per_s", "roofline_share"):
                if k in j:
                    res[k] = j[k]
        # npuc's own high-water mark (VmHWM): the wrapper's figure would include the bandwidth
        # probe `npuc bench` runs in a child process of its own.
        rss_max = max(rss_max or 0, j.get("peak_rss_bytes") or rss or 0)
    return res, rss_max


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--npuc", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    a = ap.parse_args()
    print("| model | threads | pp128 npuc / llama.cpp | pp512 npuc / llama.cpp | tg64 npuc / llama.cpp "
          "| npuc decode roofline share | peak RSS npuc / llama.cpp (MB) |")
    print("|---|---|---|---|---|---|---|")
    for name in a.models:
        model = os.path.join(a.cache, "models", MODELS[name])
        for t in a.threads:
            ours, theirs, rss_o, rss_t = [], [], [], []
            for _ in range(a.rounds):
                r, rss = llama(a.llama_bin, model, t)
                theirs.append(r)
                rss_t.append(rss)
                r, rss = npuc(a.npuc, model, t)
                ours.append(r)
                rss_o.append(rss)
            med = lambda rs, k: statistics.median(r[k] for r in rs if k in r) if any(k in r for r in rs) else float("nan")
            cells = []
            for k in ("pp128", "pp512", "tg64"):
                o, l = med(ours, k), med(theirs, k)
                cells.append(f"{o:.1f} / {l:.1f} ({o / l:.2f}x)")
            share = med(ours, "roofline_share")
            rss_o_v = max((x for x in rss_o if x), default=0) / 1e6
            rss_t_v = max((x for x in rss_t if x), default=0) / 1e6
            print(f"| {name} | {t} | {' | '.join(cells)} | {share * 100:.0f}% | {rss_o_v:.0f} / {rss_t_v:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()

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
    ap.add_argument("--llama-bin", required=True, action="append",
                    help="a llama.cpp bin directory, or LABEL=DIR; repeat to compare builds (each figure "
                         "takes the faster build's median, named in the table)")
    ap.add_argument("--npuc", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    a = ap.parse_args()
    builds = []
    for spec in a.llama_bin:
        label, sep, path = spec.partition("=")
        builds.append((label, path) if sep else (os.path.basename(os.path.dirname(spec.rstrip("/"))), spec))
    several = len(builds) > 1
    print("| model | threads | pp128 npuc / llama.cpp | pp512 npuc / llama.cpp | tg64 npuc / llama.cpp "
          "| npuc decode roofline share | peak RSS npuc / llama.cpp (MB) |")
    print("|---|---|---|---|---|---|---|")
    med = lambda rs, k: statistics.median(r[k] for r in rs if k in r) if any(k in r for r in rs) else float("nan")
    for name in a.models:
        model = os.path.join(a.cache, "models", MODELS[name])
        for t in a.threads:
            ours, rss_o = [], []
            theirs = {label: [] for label, _ in builds}
            rss_t = {label: [] for label, _ in builds}
            # Alternating: every llama.cpp build, then npuc, in each round.
            for _ in range(a.rounds):
                for label, path in builds:
                    r, rss = llama(path, model, t)
                    theirs[label].append(r)
                    rss_t[label].append(rss)
                r, rss = npuc(a.npuc, model, t)
                ours.append(r)
                rss_o.append(rss)
            cells = []
            for k in ("pp128", "pp512", "tg64"):
                o = med(ours, k)
                # llama.cpp's best: the build with the higher median for this figure.
                l, best = max((med(theirs[label], k), label) for label, _ in builds)
                others = ", ".join(f"{label} {med(theirs[label], k):.1f}" for label, _ in builds if label != best)
                note = f" [{best}; {others}]" if several else ""
                cells.append(f"{o:.1f} / {l:.1f} ({o / l:.2f}x){note}")
            share = med(ours, "roofline_share")
            rss_o_v = max((x for x in rss_o if x), default=0) / 1e6
            # Peak RSS: the lowest of the builds' peaks (the most favourable figure for llama.cpp).
            rss_t_v = min(max((x for x in v if x), default=0) for v in rss_t.values()) / 1e6
            print(f"| {name} | {t} | {' | '.join(cells)} | {share * 100:.0f}% | {rss_o_v:.0f} / {rss_t_v:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()

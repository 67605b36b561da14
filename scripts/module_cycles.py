# Lists two-module dependency cycles inside each crate of this workspace: module A -> B when
# non-test code of A names `crate::B...` (a module and its own submodules do not count).
# Usage: python3 scripts/module_cycles.py [REPO_ROOT]   (prints nothing when there are none)
import re, os, sys, itertools
root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
def modname(crate_src, path):
    rel = os.path.relpath(path, crate_src)[:-3]
    parts = rel.split(os.sep)
    if parts[-1] in ('mod', 'lib', 'main'): parts = parts[:-1]
    return '::'.join(parts)
for crate in sorted(os.listdir(os.path.join(root, 'crates'))):
    src = os.path.join(root, 'crates', crate, 'src')
    if not os.path.isdir(src): continue
    edges = {}
    mods = set()
    for d, _, fs in os.walk(src):
        for f in fs:
            if not f.endswith('.rs'): continue
            p = os.path.join(d, f); m = modname(src, p); mods.add(m)
            text = open(p).read()
            text = text.split('#[cfg(test)]')[0]
            for t in re.findall(r'crate::((?:[a-z_0-9]+::)*[a-z_0-9]+)', text):
                edges.setdefault(m, set()).add(t.replace('::', '::'))
    # resolve targets to the longest module prefix
    def resolve(t):
        parts = t.split('::')
        for k in range(len(parts), 0, -1):
            c = '::'.join(parts[:k])
            if c in mods: return c
        return ''
    g = {m: {resolve(t) for t in ts} - {m, ''} for m, ts in edges.items()}
    # ignore parent/child edges (a module and its submodules)
    def related(a, b): return a.startswith(b + '::') or b.startswith(a + '::')
    g = {m: {t for t in ts if not related(m, t)} for m, ts in g.items()}
    for a in sorted(g):
        for b in sorted(g[a]):
            if a < b and a in g.get(b, ()):
                print(f'{crate}: {a} <-> {b}')

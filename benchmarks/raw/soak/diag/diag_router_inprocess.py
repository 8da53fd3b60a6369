"""Router in this process (tracemalloc on) behind a real shard and real Envoy; clients in a
subprocess running benchmarks/soak.py's loop. Prints RSS and traced memory over requests and the
top traceback diffs between two snapshots taken after warm-up."""
import argparse, asyncio, gc, os, subprocess, sys, tempfile, time, tracemalloc, json
import psutil
sys.path.insert(0, "/work/wt/leak")
from service import router_main
from benchmarks.soak import free_port

FRAMES = int(os.environ.get("TM_FRAMES", "12"))
TRACE = os.environ.get("TM", "1") == "1"
DUR = float(os.environ.get("DUR", "240"))
WARM = float(os.environ.get("WARM", "60"))
ENV = dict(os.environ, PYTHONPATH="/work/wt/leak:/work/wt/leak/gen/python")
PY = sys.executable

async def main():
    tmp = tempfile.mkdtemp(prefix="diag-")
    shard = subprocess.Popen([PY, "-m", "service.cli", "shard", "--model-id", "/tmp/leak/cache/tiny-llama-v1",
        "--rank", "0", "--world-size", "1", "--uds-path", f"{tmp}/shard", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port())], env=ENV, cwd="/work/wt/leak", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p = argparse.ArgumentParser(); router_main.add_arguments(p)
    args = p.parse_args(["--hostname", "127.0.0.1", "--port", "0", "--shard-uds-path", f"{tmp}/shard",
        "--model-id", "tiny-llama-v1", "--tokenizer", "/tmp/leak/cache/tiny-llama-v1",
        "--max-batch-total-tokens", "131072", "--log-level", "WARNING"])
    import logging; logging.basicConfig(level=logging.WARNING)
    if os.environ.get('NOPREFIX'):
        import dataclasses
        orig = router_main.engine_config
        router_main.engine_config = lambda a, l: dataclasses.replace(orig(a, l), enable_prefix_cache=False)
    ports = asyncio.Queue(); stop = asyncio.Event()
    task = asyncio.ensure_future(router_main.serve(args, on_listening=ports.put_nowait, stop=stop))
    port = await ports.get()
    http = free_port()
    envoy = subprocess.Popen([PY, "-m", "service.gateway", "--router", f"127.0.0.1:{port}", "--http-port", str(http),
        "--http-host", "127.0.0.1", "--admin-port", str(free_port()), "--log-level", "warning"], env=ENV, cwd="/work/wt/leak",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await asyncio.sleep(8)
    counter = f"{tmp}/count"
    clients = subprocess.Popen([PY, "-c", f"""
import threading, time, sys
sys.path.insert(0, '/work/wt/leak')
import benchmarks.soak as S
from benchmarks.soak import client_loop, Counts
import os
if os.environ.get('KINDS'): S.KINDS = tuple(os.environ['KINDS'].split(','))
if os.environ.get('FIXED'): S._prompt = lambda c, i: f'client {{c}} request {{i % 50}}: alpha beta gamma'
c = Counts(); dl = time.monotonic() + {DUR}
ts = [threading.Thread(target=client_loop, args=({http}, i, dl, 10**7, c)) for i in range(16)]
[t.start() for t in ts]
while any(t.is_alive() for t in ts):
    open('{counter}', 'w').write(str(c.total())); time.sleep(1)
open('{counter}', 'w').write(str(c.total()))
print(c.done, c.failed, c.errors[:3], flush=True)
"""], env=ENV, cwd="/work/wt/leak")
    me = psutil.Process()
    def mallocstats(tag):
        import re
        fd = os.open(f"/tmp/leak/mstats-{tag}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        saved = os.dup(2); os.dup2(fd, 2)
        try: sys._debugmallocstats()
        finally: os.dup2(saved, 2); os.close(fd); os.close(saved)
        txt = open(f"/tmp/leak/mstats-{tag}.txt").read()
        keys = ["# arenas allocated current", "# bytes in allocated blocks", "# bytes in available blocks", "# bytes in free pools", "Total"]
        out = {}
        for k in keys:
            m = re.search(re.escape(k) + r"\s*=\s*([\d,]+)", txt)
            if m: out[k] = int(m.group(1).replace(",", ""))
        print("MALLOCSTATS", tag, json.dumps(out), flush=True)
    t0 = time.monotonic(); snaps = {}
    if TRACE: tracemalloc.start(FRAMES)
    while clients.poll() is None:
        await asyncio.sleep(10)
        t = time.monotonic() - t0
        try: n = int(open(counter).read() or 0)
        except Exception: n = 0
        traced = tracemalloc.get_traced_memory()[0] if TRACE else 0
        rss_before_trim = me.memory_info().rss
        if os.environ.get('TRIM'):
            import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)
        print(json.dumps({"t": round(t), "requests": n, "rss_mib": round(me.memory_info().rss / 2**20, 2), "file_mib": round(me.memory_info().shared / 2**20, 2), "anon_mib": round((me.memory_info().rss - me.memory_info().shared) / 2**20, 2), "rss_pre_trim_mib": round(rss_before_trim / 2**20, 2), "traced_mib": round(traced / 2**20, 3), "objects": len(gc.get_objects())}), flush=True)
        if os.environ.get('MSTATS') and int(t) // 10 in (6, 12, 18, 24):
            mallocstats(str(int(t)))
        if TRACE and "a" not in snaps and t >= WARM:
            gc.collect(); snaps["a"] = (n, tracemalloc.take_snapshot())
    if TRACE:
        gc.collect(); n = int(open(counter).read()); b = tracemalloc.take_snapshot()
        na, a = snaps["a"]
        st = b.compare_to(a, "traceback")
        tot = sum(x.size_diff for x in st)
        print(f"=== traced diff {tot} B over {n - na} requests ({tot / max(1, n - na):.1f} B/req)")
        for x in st[:10]:
            print(f"+{x.size_diff} B count {x.count_diff:+d}")
            for line in x.traceback.format()[-10:]: print("   ", line)
    # object type census
    from collections import Counter
    c = Counter(type(o).__name__ for o in gc.get_objects())
    print(c.most_common(25))
    stop.set(); await task
    for pr in (envoy, shard): pr.terminate(); pr.wait(20)

asyncio.run(main())

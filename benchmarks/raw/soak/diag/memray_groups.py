from collections import defaultdict
from memray import FileReader
r = FileReader("/tmp/leak/mem.bin")
recs = list(r.get_high_watermark_allocation_records(merge_threads=True))
arena = [a for a in recs if any(fn == "new_arena" for fn, _, _ in a.native_stack_trace(max_stacks=3))]
print("arenas: %d records, %.1f MiB" % (len(arena), sum(a.size for a in arena) / 2**20))
other = [a for a in recs if a not in arena]
print("other: %d records, %.1f MiB" % (len(other), sum(a.size for a in other) / 2**20))
groups = defaultdict(lambda: [0, 0])
skip = ("malloc", "calloc", "realloc", "gpr_", "operator new", "PyMem", "_PyObject", "PyObject_", "pymalloc", "_PyMem", "raw_", "je_", "__libc", "tracemalloc")
for a in other:
    st = a.native_stack_trace(max_stacks=30)
    key = []
    for fn, f, line in st:
        if fn.startswith(skip) or fn in ("_PyObject_Malloc",):
            continue
        key.append(f"{fn} {f.split('/')[-1]}:{line}")
        if len(key) == 6:
            break
    g = groups[tuple(key)]
    g[0] += a.size; g[1] += a.n_allocations
for k, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"--- {size/1024:.1f} KiB in {n} allocs")
    for x in k: print("    ", x)

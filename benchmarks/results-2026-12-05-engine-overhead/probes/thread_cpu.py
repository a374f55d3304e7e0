"""Samples per-thread CPU (utime+stime, clock ticks) of the first `kvattn ... serve` process, every 0.5 s."""
import os, sys, time, json
tick = os.sysconf("SC_CLK_TCK")
def find():
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try: cmd = open(f"/proc/{pid}/cmdline","rb").read().split(b"\0")
        except OSError: continue
        if b"serve" in cmd and b"--num-pages" in cmd and any(b"kvattn" in c for c in cmd): return pid
pid = None
while pid is None:
    pid = find(); time.sleep(0.2)
out = []
while os.path.exists(f"/proc/{pid}"):
    snap = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                s = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = s[s.index("(")+1:s.rindex(")")]
                f = s[s.rindex(")")+2:].split()
                snap[f"{tid}:{name}"] = (int(f[11]) + int(f[12])) / tick
            except OSError: pass
    except OSError: break
    out.append((time.time(), snap)); time.sleep(0.5)
json.dump(out, open(sys.argv[1], "w"))

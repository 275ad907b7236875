"""On the GPU host: unpack the carried Nsight Systems 2023.4.4 CLI (Debian's nsight-systems-target, trimmed) and
its QdstrmImporter, run the planned `nsys profile` argv exactly, import the .qdstrm into a .nsys-rep, and copy
the report and the executed-command record to $OUT."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ["OUT"])
B = Path("/tmp/nsysb")
W = Path("/tmp/nsysw")
log = open(OUT / "device.log", "w")


def say(*a):
    print(*a, flush=True)
    print(*a, file=log, flush=True)


def sh(argv, timeout=60, **kw):
    t0 = time.time()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
        rc, out = p.returncode, (p.stdout + p.stderr)
    except Exception as e:  # noqa: BLE001
        rc, out = -1, repr(e)
    say(f"$ {' '.join(map(str, argv))}  [rc={rc}, {time.time() - t0:.1f}s]")
    say(out[-6000:])
    return rc, out


plan = json.loads((HERE / "planned.json").read_text())
for c in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"], ["uname", "-r"],
          ["python3", "-c", "import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda)"],
          ["bash", "-c", "ls -d /opt/nvidia/*/ /opt/nvidia/nsight-compute/*/host/* 2>&1 | head; which nsys ncu"]):
    sh(c)
B.mkdir(parents=True, exist_ok=True)
sh(["tar", "-C", str(B), "-xJf", str(HERE / "bundle.tar.xz")], timeout=120)
nsysdir = B / "nsys" / "target-linux-x64"
imp = B / "nsys" / "host-linux-x64" / "QdstrmImporter"
need = B / "need"
need.mkdir(exist_ok=True)
rc, out = sh(["ldd", str(imp)], env={**os.environ, "LD_LIBRARY_PATH": str(imp.parent)})
for line in out.splitlines():
    if "not found" in line:
        name = line.split()[0]
        src = B / "syslib" / name
        if src.exists() and not (need / name).exists():
            os.symlink(src, need / name)
say("linked from Debian:", sorted(os.listdir(need)))
sh(["ldd", str(nsysdir / "nsys")])
sh([str(nsysdir / "nsys"), "--version"])
W.mkdir(exist_ok=True)
shutil.copy(HERE / "work.py", W / "work.py")
env = {**os.environ, "PATH": f"{nsysdir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
t0 = time.time()
rc, out = sh(plan["argv"], timeout=int(plan.get("timeout_s", 180)), cwd=W, env=env)
if not (W / (plan["output"] + ".qdstrm")).exists() and not (W / (plan["output"] + ".nsys-rep")).exists():
    say("no report from the planned argv: retrying once without the capture range (whole process)")
    argv2 = [a for a in plan["argv"] if not a.startswith("--capture-range")]
    rc2, out2 = sh(argv2, timeout=150, cwd=W, env=env)
    plan = {**plan, "retry_argv": argv2, "retry_rc": rc2}
    out += "\n--- retry ---\n" + out2
executed = {**plan, "executed_argv": plan["argv"], "cwd": str(W), "rc": rc, "started": started,
            "wall_s": round(time.time() - t0, 2), "nsys": str(nsysdir / "nsys"), "output_tail": out[-3000:]}
(OUT / "nsys_profile.log").write_text(out)
base = W / plan["output"]
qd = base.with_suffix(".qdstrm") if not str(base).endswith(".qdstrm") else base
say("files:", sorted((p.name, p.stat().st_size) for p in W.iterdir()))
rep = W / (plan["output"] + ".nsys-rep")
if not rep.exists() and qd.exists():
    ienv = {**os.environ, "LD_LIBRARY_PATH": f"{imp.parent}:{need}", "QT_QPA_PLATFORM": "offscreen"}
    irc, iout = sh([str(imp), "-i", str(qd), "-o", str(rep)], timeout=240, env=ienv)
    executed["import"] = {"argv": ["QdstrmImporter", "-i", qd.name, "-o", rep.name], "rc": irc}
say("files:", sorted((p.name, p.stat().st_size) for p in W.iterdir()))
if rep.exists() and rep.stat().st_size < 15 * 2**20:
    shutil.copy(rep, OUT / rep.name)
elif qd.exists():
    n = 0
    with open(qd, "rb") as f:
        while (chunk := f.read(15 * 2**20)) and n < 3:
            (OUT / f"{qd.name}.part{n}").write_bytes(chunk)
            n += 1
    executed["qdstrm_parts"] = n
(OUT / "executed.json").write_text(json.dumps(executed, indent=1))
say("done")

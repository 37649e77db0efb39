"""Copy a wheel without the members matching the given regexes, and drop them from its RECORD."""
import sys, zipfile, re
src, dst, *patterns = sys.argv[1:]
pat = re.compile("|".join(patterns))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if pat.search(info.filename):
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "\n".join(l for l in data.decode().splitlines() if not pat.search(l.split(",")[0])).encode() + b"\n"
        zout.writestr(info, data)

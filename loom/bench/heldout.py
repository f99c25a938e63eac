"""Held-out prose for quality measurements: Jane Austen's novels from Debian's `r-cran-janeaustenr` package.

The package stores the six novels in an R lazy-load database (`janeaustenr/data/Rdata.{rdx,rdb}`): the
gzip-compressed index maps each variable to an (offset, length) blob of the .rdb file, and each blob is a
4-byte big-endian length followed by a zlib stream of a serialized R character vector (one line of text per
element). Read with the `rdata` package (shared/DESIGN.md, "Real data"). The .deb is fetched once with
`apt-get download` and cached under `$LOOM_CACHE_DIR/heldout` (or ~/.cache/loom/heldout).
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import zlib
from pathlib import Path

BOOKS = ("prideprejudice", "emma", "mansfieldpark", "northangerabbey", "persuasion", "sensesensibility")
PACKAGE = "r-cran-janeaustenr"


def _cache() -> Path:
    root = Path(os.environ.get("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom")
    path = root / "heldout"
    path.mkdir(parents=True, exist_ok=True)
    return path


def janeausten_data_dir() -> Path:
    """The directory holding Rdata.rdx / Rdata.rdb, fetching and unpacking the Debian package once.

    Raises:
        RuntimeError: apt-get or dpkg-deb is missing, or the package cannot be downloaded.
    """
    root = _cache() / PACKAGE
    data = root / "usr/lib/R/site-library/janeaustenr/data"
    if (data / "Rdata.rdb").is_file():
        return data
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: the held-out prose comes from Debian's {PACKAGE} package")
    work = _cache() / "download"
    work.mkdir(exist_ok=True)
    proc = subprocess.run(["apt-get", "download", PACKAGE], cwd=work, capture_output=True, text=True)
    debs = sorted(work.glob(f"{PACKAGE}_*.deb"))
    if proc.returncode != 0 or not debs:
        raise RuntimeError(f"apt-get download {PACKAGE} failed (run 'apt-get update' first?): {proc.stderr.strip()}")
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], check=True)
    return data


def janeausten_text(book: str = "prideprejudice") -> str:
    """The text of one novel, its lines joined by newlines.

    Raises:
        ValueError: unknown book. RuntimeError: the package cannot be had (see janeausten_data_dir).
    """
    if book not in BOOKS:
        raise ValueError(f"book must be one of {list(BOOKS)}, got {book!r}")
    import warnings

    try:
        import rdata
    except ImportError as exc:
        raise RuntimeError("reading the Jane Austen novels needs the rdata package: pip install 'loom[bench]' "
                           "(or pip install rdata)") from exc

    data = janeausten_data_dir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns that the index has no RDS header; it is a bare stream
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes())))
        offset, length = (int(v) for v in index["variables"][book])
        with open(data / "Rdata.rdb", "rb") as f:
            f.seek(offset)
            blob = f.read(length)
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:])))
    return "\n".join(str(line) for line in lines)


def check_not_calibrated_on(models: list[str | None], book: str) -> None:
    """Evaluation text must be disjoint from calibration text: refuse a novel that a `loom quantize` checkpoint
    among `models` (directories; GGUF files and None are skipped) records in a "calibration" label of its
    config.json (quantization_config's, or loom's SmoothQuant preparation's); the default calibration reads
    CALIBRATION_BOOK of loom/quant/quantize.py.

    Raises:
        ValueError: a checkpoint was calibrated on `book`.
    """
    import json

    for model in models:
        config = Path(model) / "config.json" if model is not None else None
        if config is None or not config.is_file():
            continue
        try:
            labels = _calibration_labels(json.loads(config.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # the loader reports an unreadable config
        if any(book in label.lower() for label in labels):
            raise ValueError(f"--book {book}: {model} was calibrated on that novel; evaluation text must be disjoint "
                             "from calibration text (pick another --book, or --text-file)")


def _calibration_labels(node: object) -> list[str]:
    """Every string value of a "calibration" key anywhere in a parsed config.json."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k == "calibration" and isinstance(v, str)]
        return found + [label for v in node.values() for label in _calibration_labels(v)]
    if isinstance(node, list):
        return [label for v in node for label in _calibration_labels(v)]
    return []

"""What a dataset folder's card (``README.md``: YAML metadata, then text) says, read as data only.

``draftsmith data`` writes the card beside ``manifest.json``; ``datasets.load_dataset(FOLDER)`` and the
hub find the split's files through it. The card is read with ``yaml.safe_load`` (no tag of it makes an
object), and a card naming a data file outside its folder is refused: a copied or edited card would
otherwise have the folder's rows read from anywhere on the disk.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import yaml

from draftsmith.specdec.errors import DraftsmithError

CARD = "README.md"
MANIFEST = "manifest.json"


def card_metadata(folder: Path) -> dict:
    """The YAML metadata of ``folder``'s card; {} when it has no card, no metadata, or metadata that
    does not parse (a card is documentation first: its text alone is no error)."""
    path = Path(folder) / CARD
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---\n") or "\n---" not in text[3:]:
        return {}
    try:
        metadata = yaml.safe_load(text[4:].split("\n---", 1)[0])
    except yaml.YAMLError:
        return {}
    return metadata if isinstance(metadata, dict) else {}


def listed_files(metadata: dict) -> list[str]:
    """Every data file path the card's ``configs`` name (a path, or a list of them, per split)."""
    paths = []
    for config in metadata.get("configs") or []:
        files = config.get("data_files") if isinstance(config, dict) else None
        for entry in files if isinstance(files, list) else [files] if files else []:
            listed = entry.get("path") if isinstance(entry, dict) else entry
            paths.extend(str(p) for p in (listed if isinstance(listed, list) else [listed]) if p is not None)
    return paths


def check_card_files(folder: Path) -> None:
    """Refuse a card that names a data file outside ``folder`` (an absolute path, or one through ``..``)."""
    for listed in listed_files(card_metadata(folder)):
        path = PurePosixPath(listed)
        if path.is_absolute() or ".." in path.parts or "://" in listed:
            raise DraftsmithError(
                f"{Path(folder) / CARD} lists the data file {listed}, outside the folder; a dataset card names "
                "files inside its own folder: remove that entry, or copy the dataset folder again"
            )


def missing_manifest(folder: Path) -> str | None:
    """For a folder ``draftsmith data`` built (its card says so) that lacks ``manifest.json``: the one line
    that says so; None for any other folder."""
    if (Path(folder) / MANIFEST).is_file() or "draftsmith" not in card_metadata(folder):
        return None
    return (
        f"{folder} was built by draftsmith data but has no {MANIFEST} (copied without it?); copy the folder "
        f"again with its {MANIFEST}, or build it again with draftsmith data"
    )

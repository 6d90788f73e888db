"""docs/gallery/ is what scripts/gallery.py draws from the library now, and it draws every
mask and score mod of flexattn.mods."""

from __future__ import annotations

import pathlib
import sys

from flexattn import mods

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gallery  # noqa: E402

sys.path.pop(0)


def test_gallery_is_current():
    stale = gallery.stale_files(gallery.OUT)
    assert not stale, f"run python3 scripts/gallery.py: {stale}"


def test_every_mod_has_a_picture():
    drawn = {name.split("-")[0].removesuffix(".png") for name in gallery.render()}
    helpers = {"alibi_slopes"}  # returns slopes, not a mod (drawn through alibi)
    missing = set(mods.__all__) - helpers - drawn
    assert not missing, f"add these to scripts/gallery.py: {sorted(missing)}"

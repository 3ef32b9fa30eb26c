"""Write memcalc/cli/zoo_listing.py: the model zoo's entries as plain data, which ``memcalc zoo``
lists without importing torch or the zoo's model definitions.

Run it after adding or changing a zoo entry (tests/test_startup.py fails until then):

    python scripts/write_zoo_listing.py
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memcalc.cli.zoo import listing_source  # noqa: E402  (after the path above)

TARGET = ROOT / "memcalc" / "cli" / "zoo_listing.py"


def main() -> None:
    """Rewrite the listing from the registry, and say whether it changed."""
    text = listing_source()
    changed = not TARGET.exists() or TARGET.read_text() != text
    TARGET.write_text(text)
    print(f"{'wrote' if changed else 'unchanged:'} {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

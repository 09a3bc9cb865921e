"""Writes an SVG screenshot of each console pane into docs/console/, from the fixed demo state.

    python3 docs/make_screenshots.py            # all panes, 120x40
    python3 docs/make_screenshots.py --check    # exit 1 if a committed SVG differs from a fresh one

The state is :func:`tandem.console.demo.demo_state` (no clock, no randomness), so the pictures
change only when a pane or the demo data does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tandem.console.app import ConsoleApp
from tandem.console.demo import demo_state

OUT = Path(__file__).resolve().parent / "console"
SIZE = (120, 40)
SHOTS = {  # file name -> keys pressed after start
    "services": ["1"],
    "blocks": ["2", "tab", "down"],  # the second sequence: prefix-cache and handed-off blocks
    "overlap": ["3"],
    "scaling": ["4"],
    "routing": ["5"],
    "help": ["question_mark"],
}


async def shoot(keys: list[str], size: tuple[int, int] = SIZE) -> str:
    """The SVG of the demo console after pressing ``keys``."""
    app = ConsoleApp(state=demo_state())
    async with app.run_test(size=size) as pilot:
        await pilot.press(*keys)
        await pilot.pause()
        return app.export_screenshot(title="tandem console", simplify=True)


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    check = args.parse_args(argv).check
    OUT.mkdir(parents=True, exist_ok=True)
    stale = []
    for name, keys in SHOTS.items():
        svg = asyncio.run(shoot(keys))
        path = OUT / f"{name}.svg"
        if check:
            if not path.exists() or path.read_text() != svg:
                stale.append(path.name)
        else:
            path.write_text(svg)
            print(f"wrote {path.relative_to(OUT.parent.parent)} ({len(svg) // 1024} KiB)")
    if stale:
        print(f"out of date: {', '.join(stale)} (run python3 docs/make_screenshots.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Watching small files (rule sets, routing documents, endpoint lists) for changes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from pathlib import Path

log = logging.getLogger(__name__)


async def watch_file(path: Path, interval_s: float) -> AsyncGenerator[str, None]:
    """The file's text now and after every change, polled every ``interval_s``.

    Polling (rather than inotify) also sees files replaced by rename, on any filesystem;
    the content is compared, since coarse mtimes miss quick successive writes. The files
    are small, so reading them blocks the loop for microseconds. A missing file is
    reported once and waited for.
    """
    last: str | None = None
    missing_logged = False
    while True:
        try:
            text = _read(path)
        except (OSError, UnicodeDecodeError) as err:
            if not missing_logged:
                log.warning("cannot read %s: %s", path, err)
                missing_logged = True
        else:
            missing_logged = False
            if text != last:
                last = text
                yield text
        await asyncio.sleep(interval_s)  # the polling period


def _read(path: Path) -> str:
    return path.read_text("utf-8")

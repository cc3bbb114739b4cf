"""Whether the server holds a staged run whole already, asked of the server: its state,
names and files (`RunFiles`, as wandb's public API asks), and the files wandb-core made,
read back. What is compared is in `whole`, pure; this module asks and reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..content import StagedContent, read_logged_run
from .server import Held, ServerClient, ServerError
from .staging import staged_files, staged_md5s
from .whole import READ_BACK, files_changed, files_expected, made_files_stale, not_held_whole

if TYPE_CHECKING:
    from .deliver import Delivery


def not_whole_on_server(
    client: ServerClient,
    entity: str | None,
    project: str,
    delivery: Delivery,
    held: Held,
    content: StagedContent,
) -> list[str]:
    """What keeps the server's run from being what a whole upload of the staged run
    (`content`, counted from `delivery.log`) leaves (`whole.not_held_whole`); [] when
    nothing does: then it is not sent again (that would send no row: see
    `remainder.sends_no_row`). `held` (the server holds every staged row) was asked.

    That the server's run is whole does not show that its last upload ended whole: a
    run finished by an earlier upload stays finished while a later one, of more rows,
    is stopped before it puts its files. So the files wandb-core makes (the summary,
    the config, the console) must be this run's too: as this ledger knows, having
    verified the run from these very files (`verified_before`), or else as read back
    (`whole.made_files_stale`). A server or staging that cannot say gets it sent."""
    try:
        listing = client.run_files(entity, project, delivery.run_id, urls_of=READ_BACK)
        if listing is None:
            return ["the server lists no such run"]
        expected = files_expected(staged_files(delivery.run_dir / "files"), content)
        logged = read_logged_run(delivery.log, READ_BACK["output.log"])
        problems = not_held_whole(content, held, listing, expected, logged, delivery.exit_code)
        if not problems:  # (every file at its size: only now is each worth hashing)
            sized = [name for name, size in expected.items() if size is not None]
            problems = files_changed(staged_md5s(delivery.run_dir / "files", sized), listing)
    except (ServerError, OSError, ValueError) as exc:  # (ValueError: a value not JSON)
        return [f"not known to be whole: {exc}"]
    if problems or delivery.verified_before:
        return problems
    limits = {name: limit for name, limit in READ_BACK.items() if name in expected}
    return made_files_stale(client.read_back(listing.urls, limits), content, logged)

"""Whether the server holds a staged run whole, asked of the server: its state, names and
files (`RunFiles`, as wandb's public API asks), the files wandb-core made, read back, and
every history row, read back by step (`HistoryPage`). What is compared is in `whole` and
`rowcheck`; this module asks and reads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from ..upload import Delivery, Held, ServerClient, ServerError, staged_files, staged_md5s
from ..wandbcore import StagedContent, StepRuns, read_logged_run
from .remainder import staged_rows
from .rowcheck import (
    INT64_MAX,
    INT64_MIN,
    compare_steps,
    halves,
    room,
    sampled,
    value_problem,
    windows,
)
from .whole import (
    READ_BACK,
    files_changed,
    files_expected,
    files_missing,
    made_files_stale,
    not_held_whole,
)

# W&B's cloud counts a run's lines asynchronously, some 2-4 s after they arrive (wandb
# PR #12421), and answers its history tail and summary from a cache that can be stale
# (PR #12668). So counts that fall short of what an upload sent are asked again, every
# `COUNTS_POLL` seconds, until `COUNTS_LAG` seconds after the upload ended: counts asked
# after that are the server's own, not late ones, whatever they say.
COUNTS_LAG = 10.0
COUNTS_POLL = 0.5
COUNTS_LATE = (
    "the server's line counts or last row fall short of what was sent; W&B fills them in "
    "some seconds after the rows"
)


def counts_behind(content: StagedContent, held: Held) -> bool:
    """True when what the server answers of a run falls short of a whole upload of
    `content` in a way late counts explain: fewer lines, or the last history row not
    the last one sent (a stale tail). More lines than sent are no lag."""
    rows = len(content.step_items)
    if not held.exists:
        return True
    if held.history_lines < rows or held.events_lines < content.events:
        return True
    if held.log_lines < content.console_lines:
        return True
    return bool(rows) and held.history_lines == rows and held.last_step != content.history_steps[-1]


def counts_caught_up(
    client: ServerClient,
    entity: str | None,
    project: str,
    run_id: str,
    held: Held,
    behind: Callable[[Held], bool],
    until: float,
    stop: threading.Event | None = None,
) -> Held:
    """What the server holds of `run_id`, asked again while `behind` says the answer
    `held` lags, until `until` (a `time.monotonic()`): the last answer is asked at or
    after it, so that it is no late one. Raises ServerError as `ServerClient.held`."""
    while behind(held):
        left = until - time.monotonic()
        if left <= 0 or (stop is not None and stop.is_set()):
            return held
        if stop is None:
            time.sleep(min(COUNTS_POLL, left))
        else:
            stop.wait(min(COUNTS_POLL, left))
        held = client.held(entity, project, run_id)
    return held


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
        problems = not_held_whole(
            content, held, listing, expected, logged, delivery.exit_code, delivery.config_checked
        )
        if not problems:  # (every file at its size: only now is each worth hashing)
            sized = [name for name, size in expected.items() if size is not None]
            problems = files_changed(staged_md5s(delivery.run_dir / "files", sized), listing)
    except (ServerError, OSError, ValueError) as exc:  # (ValueError: a value not JSON)
        return [f"not known to be whole: {exc}"]
    if problems or delivery.verified_before:
        return problems
    limits = {name: limit for name, limit in READ_BACK.items() if name in expected}
    return made_files_stale(client.read_back(listing.urls, limits), content, logged)


def rows_not_held(
    client: ServerClient,
    entity: str | None,
    project: str,
    delivery: Delivery,
    held: Held,
    content: StagedContent,
    every_value: bool = False,
) -> list[str]:
    """What the server lacks of the history rows a whole upload of the staged run sends:
    each step sent must be there as often as it was sent and nothing else, and the values of
    a sample of the rows (of every row with `every_value`) must be the ones sent (see
    `rowcheck`). Every row is read back, a page at a time; [] when the server holds them
    all. Raises ServerError when the server cannot be asked or answers out of turn."""
    steps = content.history_steps  # (the step each staged row is sent at, by index)
    # Every log wandb writes sends its rows at rising steps; those are compared as runs
    # (`StepRuns`), so that a follow's round costs the rows it adds, not the rows it holds.
    rising = steps.rising_from(INT64_MIN) and not (steps and steps[-1] == INT64_MAX)
    sent = steps if rising else list(steps)
    # Only the rows still in the staged log are read: the first `rows_cut` were on the
    # server before this upload, cut from the log (their steps are checked all the same).
    cut = delivery.rows_cut
    # The rows an earlier upload of this process read back are not read again (a follow's
    # rounds), if the staged run begins with them and the server held them before this
    # upload (they are cut from its log): the rest, each step sent after theirs, are read
    # from the step after theirs. Rows this upload sent are read back, whatever was before.
    before = StepRuns.of(delivery.steps_checked)
    held_before = len(before) <= cut and steps[: len(before)] == before
    checked = len(before) if rising and held_before else 0
    floor = sent[checked - 1] + 1 if checked else None
    wanted = [checked + i for i in (range if every_value else sampled)(len(sent) - checked)]
    staged = (
        (cut + i, row)
        for i, row in staged_rows(delivery.log, [i - cut for i in wanted if i >= cut])
    )
    # the steps still to read back, in the order the server gives them (see `rowcheck`)
    order = list(steps[checked:]) if rising else sorted(s for s in sent if s != INT64_MAX)
    if not rising:  # (steps that wrapped past int64: compare the rows of steps sent once)
        once = {step for step, count in Counter(order).items() if count == 1}
        by_sent = {sent[i]: row for i, row in staged if sent[i] in once}
        position = {step: i for i, step in enumerate(order)}
        staged = iter(sorted((position[step], row) for step, row in by_sent.items()))
    else:  # (rows from `checked` on, at their place in `order`: a list, read a row at a time)
        staged = ((index - checked, row) for index, row in staged)
    sent = order
    pending = next(staged, None)
    held_steps: list[int | None] = []
    differing: list[str] = []
    todo = windows(order, held.last_step)
    if floor is not None:
        todo = [(max(lo, floor), hi) for lo, hi in todo if hi > floor]
    # Past the last step sent and the server's tail, which can be stale (wandb PR #12668):
    # any row there is one too many, so this window is read once, not halved. It is asked
    # for together with the last window (one request a run fewer, most runs holding one
    # page); an answer that fills the two is read again as the two, as before.
    beyond = (todo[-1][1] if todo else INT64_MIN if floor is None else floor, INT64_MAX)
    joined = None
    if beyond[0] < INT64_MAX:
        if todo:
            joined = todo[-1] = (todo[-1][0], INT64_MAX)
        else:
            todo.append(beyond)
    budget = MAX_REQUESTS_PER_WINDOW * len(todo) + MAX_REQUESTS_SPARE
    while todo:
        window = todo.pop(0)
        most = room(window, order)
        budget -= 1
        if budget < 0:
            raise ServerError(
                f"every page of {delivery.run_id}'s rows came back full, more "
                "often than any run of this size needs"
            )
        rows = client.history_page(entity, project, delivery.run_id, window, most)
        if len(rows) > most:
            raise ServerError(
                f"the server answered more rows than asked for ({len(rows)} of "
                f"{most}) at steps {window[0]}-{window[1] - 1}"
            )
        if len(rows) == most and window == joined:
            todo[:0] = [(window[0], beyond[0]), beyond]
            continue
        if len(rows) == most and halves(window) != [window] and window != beyond:
            todo[:0] = halves(window)  # (maybe a sample of a fuller window: read it in two)
            continue
        by_step: dict[int | None, dict] = {}
        for row in rows:
            step = row.get("_step")
            step = step if isinstance(step, int) and not isinstance(step, bool) else None
            if step is not None and not window[0] <= step < window[1]:
                raise ServerError(
                    f"the server answered a row at step {step} when asked for "
                    f"steps {window[0]}-{window[1] - 1}"
                )
            held_steps.append(step)
            by_step.setdefault(step, row)
        while pending is not None and sent[pending[0]] < window[1]:
            index, staged_row = pending
            if sent[index] in by_step:
                problem = value_problem(sent[index], staged_row, by_step[sent[index]])
                differing += [problem] if problem else []
            pending = next(staged, None)
    # (of all the rows sent: those before `checked` were read back by an earlier upload)
    problems = compare_steps(order, held_steps).problems(checked + len(order))
    if differing:
        more = f" (and {len(differing) - 1} more rows differ)" if len(differing) > 1 else ""
        problems.append(differing[0] + more)
    return problems


# A window is read in halves while its answers come back full; a run as the uploader sends
# it needs a few halvings at most (a step written twice), so past this many questions per
# window the answers are not a server's reading of this run.
MAX_REQUESTS_PER_WINDOW = 8
MAX_REQUESTS_SPARE = 64


class RowsLost(Exception):
    """The server lost rows inside a run it counts whole (`args[0]`: what, and why a rerun
    cannot send them)."""


LOST_ROWS = (
    "the line counts reach past these rows, and wandb's uploader sends only rows past the "
    "server's line count, so a rerun cannot send them again (`wbmerge sync --resend` sends "
    "the run whole again over what the server holds)"
)


def rows_held(
    client: ServerClient,
    entity: str | None,
    project: str,
    delivery: Delivery,
    held: Held,
    content: StagedContent,
    every_value: bool = False,
) -> list[str]:
    """`rows_not_held` of a run whose line counts say the server holds it whole; [] when it
    does. Rows lost inside the run cannot be sent again (wandb-core continues a run after
    the server's line count), so such a run is marked refused: a rerun says why too."""
    try:
        problems = rows_not_held(client, entity, project, delivery, held, content, every_value)
    except ServerError as exc:
        return [f"its rows could not be read back: {exc}"]
    if problems:
        delivery.refused = True
        problems.append(LOST_ROWS)
    return problems


def saved_files_missing(
    client: ServerClient, entity: str | None, project: str, delivery: Delivery
) -> list[str]:
    """The saved files of `delivery` (`Delivery.saved_files`, counted from the sources) that
    the server lacks after its upload, or holds at another size, a line each naming it; []
    when it holds every one. A staged run that lost one (or an uploader that skipped it)
    is then not recorded as synced."""
    try:
        listing = client.run_files(entity, project, delivery.run_id)
    except ServerError as exc:
        return [f"could not be verified: {exc}"]
    held = listing.sizes if listing is not None else {}
    return [f"saved {problem}" for problem in files_missing(delivery.saved_files, held)]

"""The HTML report (verify/report_html.py): the same bytes in every process, nothing loaded from anywhere, every
string escaped, "not run" sections, and a real headless Chromium rendering every section at 1280 px and 390 px.

The inputs are fixtures made from one run of examples/tiny.toml (tests/verify/data/): its audit report with a
fabricated serving section (serving is not built yet), and the figures the renderer takes beside the report.

The browser test drives Debian's ``chromium-headless-shell`` through Playwright (which cannot download browsers
here). It looks for the binary in ``LEDGER_CHROMIUM`` and then in the package's paths, and skips when it finds none,
unless ``CI=true``, where a missing browser (or matplotlib, or Playwright) fails. ``LEDGER_WRITE_SCREENSHOT=1``
also writes the full-page 1280 px screenshot to docs/report-screenshot.png.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from ledger.errors import InputError

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
REPORT_FIXTURE = DATA / "report_fixture.json"
FIGURES_FIXTURE = DATA / "figures_fixture.json"
SCREENSHOT = REPO / "docs" / "report-screenshot.png"
CHROMIUM_PATHS = ("/usr/lib/chromium/chromium-headless-shell", "/usr/bin/chromium-headless-shell",
                  "/usr/lib/chromium/chromium", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]
SECTIONS = ["Training", "Recovery", "Learning", "Serving"]
PLOTS = 10  # training 3, recovery 2, learning 3, serving 2
CONTRACTS = ("quality", "efficiency", "recovery", "serving")


def _unavailable(reason: str) -> None:
    """Skip, except in CI, where what the test needs must be installed."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: not skipping)")
    pytest.skip(reason)


def _inputs() -> tuple[dict[str, Any], dict[str, Any]]:
    return json.loads(REPORT_FIXTURE.read_text()), json.loads(FIGURES_FIXTURE.read_text())


def _render(report: dict[str, Any], figures: dict[str, Any], format: str | None = None) -> bytes:
    from verify.report_html import render_report

    if format is None:
        return render_report(report, figures)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _unavailable("matplotlib is not installed (pip install 'matplotlib==3.11.*')")
    return render_report(report, figures, format)


@pytest.fixture(scope="module")
def page() -> bytes:
    return _render(*_inputs())


class _Outline(HTMLParser):
    """Tags, ids and the figure → (svg, table) nesting of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.ids: list[str] = []
        self.figures: list[set[str]] = []
        self._depth: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if a.get("id"):
            self.ids.append(str(a["id"]))
        if tag == "figure":
            self.figures.append(set())
        elif self.figures and "figure" in self._depth:
            self.figures[-1].add(tag)
        if tag not in {"meta", "br", "img", "input", "link", "path", "use", "rect", "circle", "line", "polyline",
                       "polygon", "stop", "ellipse"}:
            self._depth.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        for k, v in attrs:
            if k == "id" and v:
                self.ids.append(v)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._depth:
            while self._depth and self._depth.pop() != tag:
                pass


def _outline(page: bytes) -> _Outline:
    o = _Outline()
    o.feed(page.decode("utf-8"))
    return o


# ------------------------------------------------------------------------------------------- determinism


@pytest.mark.slow
def test_two_processes_render_the_same_bytes(page: bytes, tmp_path: Path) -> None:
    code = ("import json, sys\n"
            "from verify.report_html import render_report\n"
            "page = render_report(json.load(open(sys.argv[1])), json.load(open(sys.argv[2])))\n"
            "open(sys.argv[3], 'wb').write(page)\n")
    outs = []
    for seed in ("1", "2"):  # different str hashing, a fresh matplotlib config and font cache each
        env = {**os.environ, "PYTHONHASHSEED": seed, "MPLCONFIGDIR": str(tmp_path / f"mpl{seed}")}
        out = tmp_path / f"page{seed}.html"
        subprocess.run([sys.executable, "-c", code, str(REPORT_FIXTURE), str(FIGURES_FIXTURE), str(out)],
                       cwd=REPO, env=env, check=True, timeout=300)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1], "two processes rendered different bytes"
    assert hashlib.sha256(outs[0]).hexdigest() == hashlib.sha256(page).hexdigest()


def test_rendering_twice_in_one_process_is_identical(page: bytes) -> None:
    assert _render(*_inputs()) == page


@pytest.mark.parametrize("render", [False, True])
def test_the_renderer_imports_no_matplotlib(render: bool) -> None:
    """Neither importing the renderer nor rendering a page in the current format loads matplotlib."""
    code = ("import json, sys, verify.report_html\n"
            + (f"verify.report_html.render_report(json.load(open({str(REPORT_FIXTURE)!r})), "
               f"json.load(open({str(FIGURES_FIXTURE)!r})))\n" if render else "")
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# The fixture's page in format 1, as the matplotlib renderer drew it when format 1 was current (2026-12-06, before
# format 2): pages recorded in format 1 verify only if it still renders these bytes.
V1_FIXTURE_PAGE = "blake3:1662d382352643460ae69dc1da9260acdf97f70f0cd7b0a4d67757d4efe45ba0"


def test_format_1_still_renders_the_bytes_it_recorded() -> None:
    from ledger.digests import raw_digest

    page = _render(*_inputs(), format="ledger-report-html/1")
    assert raw_digest(page) == V1_FIXTURE_PAGE
    assert b'content="training-ledger ledger-report-html/1"' in page


def test_the_current_format_draws_its_own_svg(page: bytes) -> None:
    assert b'content="training-ledger ledger-report-html/2"' in page
    assert b"matplotlib" not in page and b"<defs>" not in page  # no matplotlib output, no ids to scope


def test_an_unknown_format_is_refused() -> None:
    from verify.report_html import render_report

    with pytest.raises(InputError, match="ledger-report-html/9"):
        render_report(*_inputs(), "ledger-report-html/9")


# ------------------------------------------------------------------------------------------ self-contained


def test_page_references_nothing_outside_itself(page: bytes) -> None:
    text = page.decode("utf-8")
    assert not re.search(r"""\b(?:src|href|action|poster|data)\s*=\s*["']?\s*(?:https?:)?//""", text, re.I)
    assert not re.search(r"<script\b", text, re.I), "the page needs no JavaScript"
    assert not re.search(r"<link\b", text, re.I)
    assert not re.search(r"<(?:img|iframe|object|embed)\b", text, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(?:https?:)?//", text, re.I)
    assert "<!DOCTYPE svg" not in text and "<?xml" not in text
    assert "default-src 'none'" in text  # the CSP makes a browser refuse anything the page might still ask for


def test_page_outline(page: bytes) -> None:
    o = _outline(page)
    tags = [t for t, _ in o.tags]
    assert tags[0] == "html" and o.tags[0][1].get("lang") == "en"
    assert len(o.ids) == len(set(o.ids)), "duplicate ids across the inlined SVGs"
    svgs = [a for t, a in o.tags if t == "svg"]
    assert len(svgs) == PLOTS
    assert all(a.get("role") == "img" and a.get("aria-label") for a in svgs)
    assert len(o.figures) == PLOTS
    assert all({"svg", "table", "figcaption"} <= f for f in o.figures), "each plot has its numbers in a table"
    assert tags.count("section") == len(SECTIONS)


def test_each_figure_names_its_receipts(page: bytes) -> None:
    text = page.decode("utf-8")
    report, figures = _inputs()
    for cap in re.findall(r"<figcaption.*?</figcaption>", text, re.S):
        assert "blake3:" in cap, cap[:200]
    for rid in [figures["audit_receipt"], report["contract"], *figures["receipts"]["training"].values(),
                figures["receipts"]["recovery"], figures["receipts"]["quality"], figures["receipts"]["serving"],
                *figures["losses"]["single"]["receipts"]]:
        assert rid in text


def test_verdict_holds_the_audit_figures(page: bytes) -> None:
    text = page.decode("utf-8")
    report, _ = _inputs()
    assert f'data-tokens>{report["learning"]["tokens_issued"]}<' in text
    for c in CONTRACTS:
        card = re.search(rf'data-contract="{c}".*?</article>', text, re.S)
        assert card is not None
        word = "PASS" if report["contracts"][c] else "FAIL"
        assert re.search(rf"<h3[^>]*>{c.capitalize()} <span class=\"badge \w+\">{word}</span>", card.group(0))


# ------------------------------------------------------------------------------------------------ inputs


def test_every_string_from_the_data_is_escaped() -> None:
    report, figures = _inputs()
    evil = '<script>alert("x")</script> & $\\alpha$'
    report["training"]["scope"] = evil
    report["recovery"]["arm"] = evil
    report["serving"]["phases"]["four"]["unavailable"] = [{"endpoint": evil, "error": "URLError"}]
    report["learning"]["breakdowns"]["family"][evil] = report["learning"]["breakdowns"]["family"].pop("sort")
    figures["losses"][evil] = figures["losses"].pop("single")
    figures["recovery"]["recovered"]["run"] = evil
    figures["serving"]["replicas"][0]["endpoint"] = evil
    text = _render(report, figures).decode("utf-8")
    assert "<script" not in text
    assert "&lt;script&gt;" in text
    # control characters and a bidi override (NUL is an HTML parse error; RLO makes text read other than it is)
    report, figures = _inputs()
    figures["log_head"] = "head\x00\x1b[2J\u202etxt"
    text = _render(report, figures).decode("utf-8")
    assert "head\\x00\\x1b[2J\\u202etxt" in text
    assert not any(c in text for c in "\x00\x1b\u202e")


def test_sections_that_did_not_run_say_so() -> None:
    report, _ = _inputs()
    report["serving"] = {"status": "not run: the serving step is not implemented yet, so serving is not approved",
                         "serving_approved": False}
    report["recovery"] = {"status": "not run"}
    report["learning"] = {"status": "not run", "quality_contract_passed": False, "serving_approved": False,
                          "tokens_issued": 0}
    report["contracts"] = dict.fromkeys(CONTRACTS, False)
    text = _render(report, {"audit_receipt": "blake3:" + "0" * 64, "log_head": None}).decode("utf-8")
    assert text.count('class="notice"') == 4  # recovery, learning, serving, and the absent loss trajectories
    assert "serving step is not implemented yet" in text
    assert "none exported" in text
    assert len(re.findall(r"<svg\b", text)) == 2  # training seconds and bytes come from the report alone
    assert text.count("data-contract=") == 4


@pytest.mark.parametrize("breakage, field", [
    (lambda f: f.pop("audit_receipt"), "figures.audit_receipt"),
    (lambda f: f.pop("log_head"), "figures.log_head"),
    (lambda f: f["losses"]["single"]["loss"].pop(), "figures.losses.single"),
    (lambda f: f["losses"]["ddp-four"]["receipts"].pop(), "figures.losses.ddp-four.receipts"),
    (lambda f: f["recovery"]["recovered"]["steps"].reverse(), "figures.recovery.recovered.steps"),
    (lambda f: f["retention"]["arms"]["single"]["changes"].append(float("nan")),
     "figures.retention.arms.single.changes"),
    (lambda f: f["serving"]["latencies"].update(four="fast"), "figures.serving.latencies.four"),
])
def test_malformed_figures_name_the_field(breakage: Any, field: str) -> None:
    report, figures = _inputs()
    breakage(figures)
    with pytest.raises(InputError, match=re.escape(field)):
        _render(report, figures)


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value inside a JSON value (itself first), with its path of keys and indices."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nodes(v, (*path, i))


def _number_paths(value: Any) -> list[tuple[Any, ...]]:
    """The path of every number (not a bool) in a JSON value."""
    return [p for p, v in _nodes(value) if isinstance(v, int | float) and not isinstance(v, bool)]


# Extreme, and still drawable: for an integer's place, and for a float's.
DRAWN = {int: (0, -1, 2**62, -(2**62), 1), float: (5e-324, -5e-324, 0.0, -0.0, 1e-300, 1e18, -1e18)}
BEYOND = (1e308, -1e300, 2**63 + 1, 10**400)


def _holder(value: Any, path: tuple[Any, ...]) -> Any:
    """What holds the value at ``path`` inside ``value``."""
    for key in path[:-1]:
        value = value[key]
    return value


def _set(inputs: list[Any], path: tuple[Any, ...], value: Any) -> None:
    _holder(inputs, path)[path[-1]] = value


def _where(path: tuple[Any, ...]) -> str:
    root, *rest = path
    return ("report", "figures")[root] + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in rest)


def test_extreme_numbers_render_or_are_refused_naming_the_field() -> None:
    """Numbers no real run records (the smallest floats, huge integers, zeros where a bar's length goes, negatives
    where counts go), ten at a time in any place of either input, each of the type it replaces: the page renders,
    or InputError names a field (steps no longer increasing, a count below 0); nothing else goes wrong."""
    rendered = 0
    for seed in range(60):
        rng = random.Random(seed)
        inputs = list(_inputs())
        for path in rng.sample(_number_paths(inputs), 10):
            _set(inputs, path, rng.choice(DRAWN[type(_holder(inputs, path)[path[-1]])]))
        try:
            page = _render(inputs[0], inputs[1])
        except InputError as e:
            assert re.match(r"(report|figures)\.", str(e)), e
            continue
        assert page.startswith(b"<!DOCTYPE html>") and page.count(b"<svg") == PLOTS
        rendered += 1
    assert rendered >= 30, f"only {rendered} of 60 rendered: the test no longer reaches the figures"


@pytest.mark.parametrize("seed", range(20))
def test_a_number_beyond_what_a_page_draws_is_refused_by_its_path(seed: int) -> None:
    rng = random.Random(seed)
    inputs = list(_inputs())
    path = rng.choice(_number_paths(inputs))
    value = rng.choice(BEYOND)
    _set(inputs, path, value)
    with pytest.raises(InputError, match=re.escape(f"{_where(path)}: {value!r}"[:60])):
        _render(inputs[0], inputs[1])


# ----------------------------------------------------------------------------------------------- browser


def _chromium() -> str:
    configured = os.environ.get("LEDGER_CHROMIUM")
    if configured:
        if not Path(configured).is_file():
            pytest.fail(f"LEDGER_CHROMIUM={configured} is not a file")
        return configured
    for path in CHROMIUM_PATHS:
        if Path(path).is_file():
            return path
    _unavailable("no Chromium found (apt-get install chromium-headless-shell, or set LEDGER_CHROMIUM)")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install 'playwright==1.65.*')")
    executable = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def page_file(page: bytes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_bytes(page)
    return path


FACTS = """() => {
    const q = s => [...document.querySelectorAll(s)];
    const box = e => e.getBoundingClientRect();
    const badge = c => c.querySelector('h3 .badge');
    const tokens = document.querySelector('[data-tokens]');
    return {
        svgs: q('svg').length,
        charts: q('figure.plot').length,
        plotsWithTable: q('figure.plot').filter(f => f.querySelector('svg') && f.querySelector('table')).length,
        tables: q('table').length,
        h1: q('h1').map(h => h.textContent.trim()),
        sections: q('section > h2').map(h => h.textContent.trim()),
        svgSizes: q('svg.chart').map(s => [box(s).width, box(s).height, box(s).right]),
        textInSvgs: q('svg.chart').map(s => s.querySelectorAll('text').length),
        textOutside: q('svg.chart').flatMap((s, i) => [...s.querySelectorAll('text')].filter(t => {
            const a = box(t), b = box(s);
            return a.left < b.left - 1 || a.right > b.right + 1 || a.top < b.top - 1 || a.bottom > b.bottom + 1;
        }).map(t => `figure ${i + 1}: ${t.textContent}`)),
        tokens: tokens ? tokens.textContent.trim() : null,
        verdicts: Object.fromEntries(q('[data-contract]').map(c =>
            [c.dataset.contract, badge(c) ? badge(c).textContent.trim() : null])),
        scrollWidth: document.documentElement.scrollWidth,
        innerWidth: window.innerWidth,
        text: document.body.innerText,
    };
}"""


def _open(browser: Any, path: Path, width: int, shot: Path | None = None,
          full_page: Path | None = None) -> tuple[dict[str, Any], list[str], list[str]]:
    """Open ``path`` at ``width`` px; the page's facts, every request it made, and its console errors and
    warnings. Any request but the page itself is recorded and refused."""
    url = path.as_uri()
    context = browser.new_context(viewport={"width": width, "height": 900}, service_workers="block")
    requests: list[str] = []
    console: list[str] = []

    def route(r: Any) -> None:
        if r.request.url == url:
            r.continue_()
        else:
            r.abort()

    context.route("**/*", route)
    pg = context.new_page()
    pg.on("request", lambda r: requests.append(r.url))
    pg.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    try:
        response = pg.goto(url, wait_until="load")
        assert response is not None and response.ok
        pg.wait_for_load_state("networkidle")
        facts: dict[str, Any] = pg.evaluate(FACTS)
        if shot is not None:
            pg.screenshot(path=str(shot))
        if full_page is not None:
            pg.screenshot(path=str(full_page), full_page=True)
    finally:
        context.close()
    return facts, requests, console


@pytest.mark.slow
def test_the_browser_check_sees_requests_and_errors(browser: Any, tmp_path: Path) -> None:
    """A control: a page that does fetch something and logs an error is caught by the same check."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html lang="en"><body><img src="http://127.0.0.1:9/x.png" alt="">'
                   "<script>console.error('boom')</script></body></html>")
    _, requests, console = _open(browser, bad, 1280)
    assert "http://127.0.0.1:9/x.png" in requests
    assert any("boom" in c for c in console)


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 390])
def test_a_real_browser_renders_every_section(browser: Any, page_file: Path, tmp_path: Path, width: int) -> None:
    report, _ = _inputs()
    shot = tmp_path / f"report-{width}.png"
    write = width == 1280 and os.environ.get("LEDGER_WRITE_SCREENSHOT") == "1"
    facts, requests, console = _open(browser, page_file, width, shot, SCREENSHOT if write else None)

    assert console == [], console
    assert requests == [page_file.as_uri()], f"requests beyond the page itself: {requests}"
    assert facts["svgs"] == PLOTS and facts["charts"] == PLOTS and facts["plotsWithTable"] == PLOTS
    assert facts["tables"] >= PLOTS + len(CONTRACTS)
    assert facts["h1"] == ["Experiment audit report"]
    assert facts["sections"] == SECTIONS
    for w, h, right in facts["svgSizes"]:
        assert w > 100 and h > 50, "a plot did not render"
        assert right <= facts["innerWidth"] + 0.5, "a plot is wider than the viewport"
    assert all(n > 5 for n in facts["textInSvgs"]), "a plot has no labels"
    assert facts["textOutside"] == [], "labels cut off at a plot's edge"
    assert facts["tokens"] == str(report["learning"]["tokens_issued"])
    assert facts["verdicts"] == {c: "PASS" if report["contracts"][c] else "FAIL" for c in CONTRACTS}
    assert facts["scrollWidth"] <= facts["innerWidth"], "the page scrolls horizontally"
    text = facts["text"]
    for c in CONTRACTS:
        assert c.capitalize() in text
    assert report["learning"]["selection"] in text and report["contract"] in text
    assert shot.stat().st_size > 10_000


def test_fixture_is_the_audit_shape() -> None:
    """The fixtures stay what the renderer documents: the audit's report keys, and figures in the module's shape."""
    report, figures = _inputs()
    assert set(report) == {"format", "prepared", "contract", "contracts", "training", "recovery", "learning",
                           "serving"}
    assert set(figures) <= {"audit_receipt", "log_head", "quality_thresholds", "receipts", "losses", "recovery",
                            "retention", "serving"}
    altered = copy.deepcopy(figures)
    altered["losses"] = {}
    assert b"figures.losses" in _render(report, altered)


def test_format_1_without_its_matplotlib_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another matplotlib series would draw other bytes: the page is not judged tampered, the check says it cannot
    run, naming the version (exit code 1, as a check that does not hold)."""
    import matplotlib

    from ledger.errors import EXIT_FAILED, MissingDependency

    monkeypatch.setattr(matplotlib, "__version__", "3.12.0")
    with pytest.raises(MissingDependency, match=r"matplotlib 3\.11; this is matplotlib 3\.12\.0") as caught:
        _render(*_inputs(), format="ledger-report-html/1")
    assert caught.value.exit_code == EXIT_FAILED and "\n" not in caught.value.one_line()


def test_format_1_with_no_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    code = ("import json, sys\n"
            "sys.modules['matplotlib'] = None  # as if not installed\n"
            "from ledger.errors import MissingDependency\n"
            "from verify.report_html import render_report\n"
            "try:\n"
            f"    render_report(json.load(open({str(REPORT_FIXTURE)!r})), json.load(open({str(FIGURES_FIXTURE)!r})),"
            " 'ledger-report-html/1')\n"
            "except MissingDependency as e:\n"
            "    print(e.one_line())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert "not installed (pip install 'matplotlib==3.11.*')" in out.stdout, out.stdout + out.stderr


def test_malformed_figures_of_any_shape_are_refused_naming_a_field() -> None:
    """Three random changes to ``figures`` (a key or an item deleted, a value replaced by null, a string, an empty
    list or object, a bool, -1 or 0): the page renders or InputError names a field of figures, never another
    error (the contract of the module docstring)."""
    outcomes = {"rendered": 0, "refused": 0}
    for seed in range(300):
        rng = random.Random(seed)
        report, figures = _inputs()
        for _ in range(3):
            path, _ = rng.choice(list(_nodes(figures))[1:])
            holder = _holder(figures, path)
            if rng.random() < 0.4:
                del holder[path[-1]]
            else:
                holder[path[-1]] = rng.choice([None, "x", [], {}, True, -1, 0])
        try:
            _render(report, figures)
            outcomes["rendered"] += 1
        except InputError as e:
            assert str(e).startswith("figures"), e
            outcomes["refused"] += 1
    assert outcomes["rendered"] >= 20 and outcomes["refused"] >= 100, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 390])
def test_the_reference_run_s_report_renders_in_a_real_browser(browser: Any, tmp_path: Path, width: int) -> None:
    """The report of the real four-host 1.7B run (shared/reference), the shape the audit produces, with no figures
    beyond it: every plot the report alone holds is drawn, at that run's scale (terabytes, thousands of seconds),
    with no label cut off; the plots it needs figures for say which are missing."""
    from tests.verify.test_statistics import REFERENCE_FILE

    if not REFERENCE_FILE.exists():
        _unavailable(f"no reference report at {REFERENCE_FILE} (set LEDGER_SHARED_DIR to the shared directory)")
    report = json.loads(REFERENCE_FILE.read_text())
    page = _render(report, {"audit_receipt": "blake3:" + "0" * 64, "log_head": None})
    path = tmp_path / "reference.html"
    path.write_bytes(page)
    facts, requests, console = _open(browser, path, width)
    assert console == [] and requests == [path.as_uri()]
    assert facts["sections"] == SECTIONS
    assert facts["svgs"] == 6  # seconds, bytes, timeline, accuracy, forest, throughput
    assert facts["textOutside"] == [], "labels cut off at a plot's edge"
    assert facts["scrollWidth"] <= facts["innerWidth"]
    assert page.decode().count("were not supplied (figures.") == 4

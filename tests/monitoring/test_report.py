"""render_report: PNGs + HTML from finished, running, crashed and several overlaid runs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from monitoring import render_report
from monitoring.report import load_run, main


def _png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


def _img_srcs(html_path: Path) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', html_path.read_text(encoding="utf-8"))


def test_report_from_tiny_loop(finished_run: Path, tmp_path: Path) -> None:
    out = render_report([finished_run], tmp_path / "report")
    assert out == tmp_path / "report" / "report.html"
    srcs = _img_srcs(out)
    for name in ("loss.png", "lr.png", "tokens_per_s.png", "mfu.png", "memory.png", "grad_norm.png", "eval.png"):
        assert name in srcs, name
    for src in srcs:
        width, height = _png_size(out.parent / src)
        assert width >= 400 and height >= 200
    page = out.read_text(encoding="utf-8")
    assert "<td>tiny-mlp</td>" in page  # config highlight read from run_dir/config.yaml
    assert "<th>steps logged</th><td>50</td>" in page and "<th>tokens</th><td>6,400</td>" in page
    assert "final eval perplexity" in page and "final train loss" in page
    assert not list(out.parent.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_running_or_crashed_run(finished_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "crashed"
    run.mkdir()
    lines = (finished_run / "metrics.jsonl").read_text().splitlines()
    stale = json.loads(lines[0])
    stale["loss"] = 123.0  # an old session's line for the same step: the later line must win
    text = json.dumps(stale) + "\n" + "\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2]  # torn tail
    (run / "metrics.jsonl").write_text(text)  # and no config.yaml at all
    loaded = load_run(run)
    steps = [s for s, _ in loaded.get("train", "loss")]
    assert steps == sorted(set(steps)) == [10, 20, 30, 40, 50]
    assert 123.0 not in [v for _, v in loaded.get("train", "loss")]
    out = render_report([run], tmp_path / "out")
    assert "loss.png" in _img_srcs(out)


def test_a_run_before_its_first_log_renders_a_page(tmp_path: Path) -> None:
    """A run that has started (its marker and config.yaml written) but logged nothing yet."""
    from core.config import save_config
    from core.files import claim_output_dir
    from pipelines.engine.config import load_run_config

    run = claim_output_dir(tmp_path / "run", "run", what="train.run_dir")
    save_config(load_run_config(None), run / "config.yaml")
    out = render_report([run], tmp_path / "report")
    assert "No metrics logged yet" in out.read_text() and _img_srcs(out) == []


@pytest.mark.parametrize("what", ["empty folder", "corpus"])
def test_a_directory_that_is_no_run_is_refused(what: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`pretrain report CORPUS` (or any folder without metrics.jsonl, config.yaml or a run marker) wrote an empty
    'No metrics logged yet' report and exited 0: one line instead, exit 2, and no report directory."""
    import sys

    from pipelines.cli import main as cli_main

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    import corpus_fixtures as cf

    target = tmp_path / "corpus"
    if what == "corpus":
        cf.make_bert_corpus(target, train_sizes=(8,), val_sizes=(4,))
    else:
        target.mkdir()
    assert cli_main(["report", str(target), "--out", str(tmp_path / "report")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{target} is not a run directory" in lines[0] and "train.run_dir" in lines[0], lines
    assert not (tmp_path / "report").exists()


def test_several_runs_overlaid(finished_run: Path, tmp_path: Path, logged_run) -> None:
    other = tmp_path / "a" / "mlp-run"  # same leaf name as finished_run: names must be told apart
    logged_run(other, steps=20, log_every=5, eval_every=10, nan_steps=frozenset({7}))
    out = render_report([finished_run, other], tmp_path / "cmp")
    page = out.read_text()
    assert page.count("mlp-run</th>") == 2 and "a/mlp-run" in page
    assert "nan_skip" in page and "events.png" in _img_srcs(out)
    loss = load_run(other).get("train", "loss")
    assert [s for s, _ in loss] == [5, 10, 15, 20]


def test_cli_entry(finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(finished_run), "--out", str(tmp_path / "r")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r" / "report.html")
    assert main([str(tmp_path / "missing")]) == 2


# ----------------------------------------------------------------------------- real browser
_PROBE = """<script>
window.addEventListener('error', function (e) {
  var b = document.documentElement;
  b.setAttribute('data-errors', (b.getAttribute('data-errors') || '') + (e.message || (e.target && e.target.src) || 'error') + ';');
}, true);
window.addEventListener('load', function () {
  var out = document.createElement('pre');
  out.id = 'img-widths';
  out.textContent = JSON.stringify(Array.from(document.images).map(function (i) { return [i.getAttribute('src'), i.naturalWidth]; }));
  document.body.appendChild(out);
});
</script>"""

_CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("chromium not installed (CI: apt-get install -y --no-install-recommends chromium)")


def _open_in_chromium(page: Path, profile: Path) -> tuple[list, str, list[str]]:
    """Load ``page`` via file:// with the probe injected; returns (naturalWidths, errors, console lines)."""
    import subprocess

    probe = page.with_name("_probe_" + page.name)
    probe.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + _PROBE, 1), encoding="utf-8")
    proc = subprocess.run(
        [
            _chromium(),
            *_CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    match = re.search(r'<pre id="img-widths">(.*?)</pre>', proc.stdout, re.S)
    assert match, "the page's load handler never ran:\n" + proc.stdout[:2000]
    errors = re.search(r'data-errors="([^"]*)"', proc.stdout)
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return json.loads(match.group(1).replace("&quot;", '"')), errors.group(1) if errors else "", console


def test_report_in_headless_chromium(finished_run: Path, tmp_path: Path) -> None:
    _chromium()
    out = render_report([finished_run], tmp_path / "report")
    widths, errors, console = _open_in_chromium(out, tmp_path / "profile")
    assert [src for src, _ in widths] == _img_srcs(out) and len(widths) >= 7
    assert all(width > 0 for _, width in widths), widths
    assert errors == "" and console == [], (errors, console)

    import subprocess

    shot = tmp_path / "report-screenshot.png"  # the test artifact
    subprocess.run(
        [
            _chromium(),
            *_CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile2'}",
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            out.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert _png_size(shot) == (1200, 2400)

    # The probe must be able to fail: a broken image and a script error are both reported.
    broken = out.with_name("broken.html")
    broken.write_text(
        out.read_text()
        .replace('src="lr.png"', 'src="missing.png"')
        .replace("</body>", "<script>console.error('probe-check')</script></body>")
    )
    widths, errors, console = _open_in_chromium(broken, tmp_path / "profile3")
    assert dict(widths)["missing.png"] == 0 and "missing.png" in errors
    assert any("probe-check" in line for line in console)


def test_an_image_runs_top1_is_drawn_with_the_evaluation_metrics(tmp_path: Path) -> None:
    """A ViT run logs `top1` at evaluation (no `accuracy`): it gets the evaluation figure like the text runs."""
    from core.config import save_config
    from core.files import claim_output_dir
    from pipelines.engine.config import load_run_config

    run = claim_output_dir(tmp_path / "run", "run", what="train.run_dir")
    save_config(load_run_config(None), run / "config.yaml")
    lines = [{"step": s, "split": "train", "time": 1000.0 + s, "loss": 2.3 - 0.01 * s, "lr": 1e-3} for s in range(1, 41)]
    lines += [{"step": s, "split": "eval", "time": 1000.0 + s, "loss": 2.2 - 0.02 * s, "top1": 0.1 + 0.01 * s} for s in (10, 20, 30, 40)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    out = render_report([run], tmp_path / "report")
    assert "eval.png" in _img_srcs(out)
    assert _png_size(tmp_path / "report" / "eval.png")[0] > 0

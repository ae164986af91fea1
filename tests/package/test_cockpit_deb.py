"""cockpit-charly-arbiter, the GPUs page's own .deb: what it holds, what it needs,
lintian, and a clean Debian 12 where apt installs it and cockpit-bridge finds it.

Built by the same `make deb` as the main package (the session's `deb` fixture);
the page is plain files, so the package holds exactly the checkout's cockpit/.
"""

from __future__ import annotations

import json
import re

import pytest
from pkgtools import CLEAN_ENV, REPO, Chroot, Deb, log, run

pytestmark = [pytest.mark.slow, pytest.mark.package]

PAGE_DIR = "/usr/share/cockpit/charly-arbiter"


def _cockpit_deb(deb: Deb) -> Deb:
    path = deb.path.with_name(f"cockpit-charly-arbiter_{deb.version}_all.deb")
    assert path.is_file(), f"make deb did not produce {path.name}"
    return Deb(path, deb.version, deb.build_seconds)


def test_holds_the_page_and_depends_on_cockpit_and_the_arbiter(deb: Deb) -> None:
    cockpit = _cockpit_deb(deb)
    listing = run(["dpkg-deb", "--contents", str(cockpit.path)]).stdout
    shipped = sorted(
        line.split()[-1].removeprefix(".") for line in listing.splitlines() if line.startswith("-")
    )
    page = sorted(
        f"{PAGE_DIR}/{path.name}"
        for path in (REPO / "cockpit").iterdir()
        if path.suffix in (".html", ".js", ".css") or path.name == "manifest.json"
    )
    docs = [p for p in shipped if p.startswith("/usr/share/doc/cockpit-charly-arbiter/")]
    assert sorted(set(shipped) - set(docs)) == page
    depends = run(["dpkg-deb", "--field", str(cockpit.path), "Depends"]).stdout
    assert f"charly-arbiter (= {deb.version})" in depends
    assert re.search(r"\bcockpit-bridge\b", depends), depends
    main = run(["dpkg-deb", "--contents", str(deb.path)]).stdout
    assert "/usr/share/cockpit" not in main, "the page belongs to its own package"


def test_lintian_reports_nothing(deb: Deb) -> None:
    cockpit = _cockpit_deb(deb)
    result = run(
        ["lintian", "--fail-on", "error,warning", "--pedantic", str(cockpit.path)],
        check=False,
        env=CLEAN_ENV,
    )
    log(f"lintian output:\n{result.stdout}")
    assert result.returncode == 0, result.stdout
    assert not [line for line in result.stdout.splitlines() if re.match(r"^[EWIP]: ", line)]


def test_apt_installs_it_and_cockpit_bridge_finds_the_page(chroot: Chroot, deb: Deb) -> None:
    cockpit = _cockpit_deb(deb)
    chroot.install(deb)
    chroot.install(cockpit)
    manifest = json.loads(chroot.path(f"{PAGE_DIR}/manifest.json").read_text())
    assert manifest["menu"]["index"]["label"] == "GPUs"
    assert manifest["config"]["command"] == ["charly-arbiter"]
    packages = chroot.run("cockpit-bridge", "--packages").stdout
    assert re.search(rf"^charly-arbiter\s.*{PAGE_DIR}", packages, re.MULTILINE), packages
    chroot.apt("remove", "cockpit-charly-arbiter")
    assert not chroot.path(PAGE_DIR).exists()

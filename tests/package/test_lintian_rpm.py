"""lintian on the .deb, and the RPM spec through the real rpmbuild and rpmspec.

lintian runs with --fail-on error,warning: every warning is either fixed or
overridden with its reason in packaging/debian/charly-arbiter.lintian-overrides.
The RPM side cannot build a binary here (Fedora's pyproject and systemd macros
are not on Debian), so it checks what can be checked for real: `rpmbuild -bs`
builds the source package, `rpmspec -P` parses the spec, and the %files list,
expanded with Fedora's paths, matches file for file what `make install-data`
installs with those same paths.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest
from pkgtools import CLEAN_ENV, REPO, VERSION, Deb, log, run

pytestmark = [pytest.mark.slow, pytest.mark.package]

SPEC = REPO / "packaging" / "rpm" / "charly-arbiter.spec"
# Fedora's values of the macros the spec's install and %files use.
FEDORA_PATHS = {
    "_prefix": "/usr",
    "_bindir": "/usr/bin",
    "_sysconfdir": "/etc",
    "_libexecdir": "/usr/libexec",
    "_datadir": "/usr/share",
    "_mandir": "/usr/share/man",
    "_sharedstatedir": "/var/lib",
    "_unitdir": "/usr/lib/systemd/system",
    "_tmpfilesdir": "/usr/lib/tmpfiles.d",
    "bash_completions_dir": "/usr/share/bash-completion/completions",
    "zsh_completions_dir": "/usr/share/zsh/site-functions",
    "fish_completions_dir": "/usr/share/fish/vendor_completions.d",
}


def test_lintian_reports_no_error_and_no_warning(deb: Deb) -> None:
    result = run(
        ["lintian", "--fail-on", "error,warning", "--pedantic", "--show-overrides", str(deb.path)],
        check=False,
        env=CLEAN_ENV,
    )
    log(f"lintian output:\n{result.stdout}")
    assert result.returncode == 0, result.stdout
    tags = [line for line in result.stdout.splitlines() if re.match(r"^[EW]: ", line)]
    assert not tags, "\n".join(tags)


def test_rpmbuild_builds_the_source_rpm(tmp_path: Path) -> None:
    run(
        [
            "make",
            "-C",
            str(REPO),
            "rpm-srpm",
            f"BUILDDIR={tmp_path}/build",
            f"DISTDIR={tmp_path}/dist",
        ],
        env=CLEAN_ENV,
    )
    srpm = tmp_path / "dist" / f"charly-arbiter-{VERSION}-1.src.rpm"
    assert srpm.is_file()
    listing = run(["rpm", "-qlp", str(srpm)], env=CLEAN_ENV).stdout.split()
    assert sorted(listing) == sorted(["charly-arbiter.spec", f"charly-arbiter-{VERSION}.tar.gz"])
    spec_version = run(["rpmspec", "-q", "--srpm", "--qf", "%{VERSION}", str(SPEC)]).stdout
    assert spec_version.strip() == VERSION, "the spec's Version is not pyproject's"


def test_spec_files_match_make_install_data(tmp_path: Path) -> None:
    defines = [
        arg for name, value in FEDORA_PATHS.items() for arg in ("--define", f"{name} {value}")
    ]
    expanded = run(["rpmspec", "-P", *defines, str(SPEC)], env=CLEAN_ENV).stdout
    files_section = expanded.split("\n%files", 1)[1].split("\n%changelog", 1)[0]
    patterns = []
    for line in files_section.splitlines()[1:]:
        line = re.sub(r"%(attr|config)\([^)]*\)\s*", "", line.split("#", 1)[0]).strip()
        if not line or line.startswith(("%dir", "%doc", "%license", "%files")):
            continue
        patterns.append(line)
    destdir = tmp_path / "root"
    run(
        [
            "make",
            "-C",
            str(REPO),
            "install-data",
            f"DESTDIR={destdir}",
            f"BUILDDIR={tmp_path}/b",
            "PREFIX=/usr",
            "SYSCONFDIR=/etc",
            "LIBEXECDIR=/usr/libexec",
            "MANDIR=/usr/share/man",
            f"UNITDIR={FEDORA_PATHS['_unitdir']}",
            f"TMPFILESDIR={FEDORA_PATHS['_tmpfilesdir']}",
            f"BASHCOMPDIR={FEDORA_PATHS['bash_completions_dir']}",
            f"ZSHCOMPDIR={FEDORA_PATHS['zsh_completions_dir']}",
            f"FISHCOMPDIR={FEDORA_PATHS['fish_completions_dir']}",
        ],
        env=CLEAN_ENV,
    )
    run(  # the cockpit-charly-arbiter subpackage's files, as %install puts them
        [
            "make",
            "-C",
            str(REPO),
            "install-cockpit",
            f"DESTDIR={destdir}",
            "PREFIX=/usr",
            "COCKPITDIR=/usr/share/cockpit/charly-arbiter",
        ],
        env=CLEAN_ENV,
    )
    installed = sorted(
        "/" + str(Path(base, name).relative_to(destdir))
        for base, _, names in os.walk(destdir)
        for name in names
    )

    def listed(path: str, pattern: str) -> bool:  # a directory in %files takes what is under it
        return fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/")

    unlisted = [f for f in installed if not any(listed(f, p) for p in patterns)]
    assert not unlisted, f"installed by make install-data, missing from the spec: {unlisted}"
    # /usr/bin/charly-arbiter comes from %pyproject_install, not from install-data.
    unmatched = [
        p
        for p in patterns
        if p != "/usr/bin/charly-arbiter" and not any(listed(f, p) for f in installed)
    ]
    assert not unmatched, f"in the spec's %files, not installed: {unmatched}"

# Build, install and package charly-arbiter.  One install layout for everyone:
# `make install` (from source), the Debian package (packaging/debian/rules
# calls `make install-data`) and the RPM (%install calls it too).
#
#   make man | completions        generate into $(BUILDDIR)
#   make install DESTDIR=... PREFIX=...
#   make install-cockpit          the Cockpit page alone (its own binary package)
#   make deb                      -> $(DISTDIR)/charly-arbiter_VERSION_all.deb and
#                                    $(DISTDIR)/cockpit-charly-arbiter_VERSION_all.deb
#   make lintian                  lintian on those .debs (fails on warnings)
#   make rpm-srpm                 -> $(DISTDIR)/charly-arbiter-VERSION-1.src.rpm
#
# Debian's python3 on purpose: the packages run on it (not a pyenv or venv one).
PYTHON ?= /usr/bin/python3
PREFIX ?= /usr/local
DESTDIR ?=
SYSCONFDIR ?= /etc
BINDIR ?= $(PREFIX)/bin
LIBEXECDIR ?= $(PREFIX)/libexec
MANDIR ?= $(PREFIX)/share/man
UNITDIR ?= $(PREFIX)/lib/systemd/system
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
BASHCOMPDIR ?= $(PREFIX)/share/bash-completion/completions
ZSHCOMPDIR ?= $(PREFIX)/share/zsh/site-functions
FISHCOMPDIR ?= $(PREFIX)/share/fish/vendor_completions.d
DOCDIR ?= $(PREFIX)/share/doc/charly-arbiter
# Files for other programs to read: the Prometheus alerting rules, the Grafana dashboard.
PKGDATADIR ?= $(PREFIX)/share/charly-arbiter
# Cockpit finds packages in $(datadir)/cockpit (/usr/share or /usr/local/share).
COCKPITDIR ?= $(PREFIX)/share/cockpit/charly-arbiter
COCKPIT_FILES := $(wildcard cockpit/*.html cockpit/*.js cockpit/*.css cockpit/manifest.json)
# Where the libvirt hook goes.  The Debian package installs it under
# LIBEXECDIR and its postinst copies it here, so `apt remove` can take it away
# (a conffile would stay behind).
HOOK ?= $(SYSCONFDIR)/libvirt/hooks/qemu.d/charly-arbiter
# The OCI hook: its programs (the hook, the runtime wrapper for Docker, the Ollama
# drain) under LIBEXECDIR, with the Proxmox VE hookscript, and the hooks.d file where Podman and CRI-O look without
# configuration (they read no /usr/local or /etc directory unless told to).
OCIHOOKSDIR ?= /usr/share/containers/oci/hooks.d
OCILIBEXEC = $(LIBEXECDIR)/charly-arbiter
BUILDDIR ?= build
DISTDIR ?= dist

VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
NAME := charly-arbiter
# A fixed PATH for the package builds: a pyenv or venv python3 earlier on PATH
# must not end up in a Debian package.
CLEAN_PATH := /usr/sbin:/usr/bin:/sbin:/bin
UNITS := $(wildcard etc/systemd/*.service etc/systemd/*.socket etc/systemd/*.timer)

.PHONY: all man completions install install-python install-data install-cockpit install-docs deb \
	lintian rpm-srpm \
	rpm-spec-check sources clean

all: man completions

man:
	rm -rf $(BUILDDIR)/man
	PYTHONPATH=$(CURDIR) $(PYTHON) packaging/gen-manpages.py $(BUILDDIR)/man >/dev/null

completions:
	rm -rf $(BUILDDIR)/completions
	PYTHONPATH=$(CURDIR) $(PYTHON) packaging/gen-completions.py $(BUILDDIR)/completions >/dev/null

# The packages ship the documentation their own way (dh_installdocs, %doc).
install: install-python install-data install-cockpit install-docs

install-python:
	rm -rf $(BUILDDIR)/wheel
	$(PYTHON) -m build --wheel --no-isolation --outdir $(BUILDDIR)/wheel .
	$(PYTHON) packaging/install-wheel.py $(BUILDDIR)/wheel/charly_arbiter-$(VERSION)-py3-none-any.whl \
		"$(DESTDIR)" "$(PREFIX)" "$(BINDIR)"

install-data: man completions
	@# the program itself, not the installers' launcher (it imports re, and site)
	$(PYTHON) packaging/launcher.py $(DESTDIR)$(BINDIR)/charly-arbiter $(PYTHON) $(PREFIX)
	install -d -m 0755 $(DESTDIR)$(dir $(HOOK))
	@# the hook runs the program where BINDIR put it (it does nothing if that is missing)
	sed 's|^CHARLY_ARBITER=/usr/bin/charly-arbiter$$|CHARLY_ARBITER=$(BINDIR)/charly-arbiter|' \
		hooks/qemu > $(DESTDIR)$(HOOK)
	chmod 0755 $(DESTDIR)$(HOOK)
	install -d -m 0755 $(DESTDIR)$(OCILIBEXEC) $(DESTDIR)$(OCIHOOKSDIR)
	for program in hooks/oci-hook hooks/oci-runtime etc/charly-arbiter/ollama-unload; do \
		sed -e 's|/usr/bin/charly-arbiter|$(BINDIR)/charly-arbiter|g' \
			-e 's|/usr/libexec/charly-arbiter/|$(OCILIBEXEC)/|g' $$program \
			> $(DESTDIR)$(OCILIBEXEC)/$$(basename $$program) && \
		chmod 0755 $(DESTDIR)$(OCILIBEXEC)/$$(basename $$program) || exit 1; \
	done
	@# the Proxmox VE hookscript: an administrator copies it into a snippets storage
	sed 's|^CHARLY_ARBITER=/usr/bin/charly-arbiter$$|CHARLY_ARBITER=$(BINDIR)/charly-arbiter|' \
		hooks/proxmox > $(DESTDIR)$(OCILIBEXEC)/proxmox-hookscript
	chmod 0755 $(DESTDIR)$(OCILIBEXEC)/proxmox-hookscript
	sed 's|/usr/libexec/charly-arbiter/|$(OCILIBEXEC)/|g' hooks/charly-arbiter.json \
		> $(DESTDIR)$(OCIHOOKSDIR)/charly-arbiter.json
	chmod 0644 $(DESTDIR)$(OCIHOOKSDIR)/charly-arbiter.json
	install -d -m 0755 $(DESTDIR)$(SYSCONFDIR)/charly-arbiter
	@# never overwrite an administrator's configuration on a from-source reinstall
	test -e $(DESTDIR)$(SYSCONFDIR)/charly-arbiter/arbiter.toml || \
		install -m 0644 etc/charly-arbiter/arbiter.toml $(DESTDIR)$(SYSCONFDIR)/charly-arbiter/
	install -d -m 0755 $(DESTDIR)$(UNITDIR) $(DESTDIR)$(TMPFILESDIR)
	for unit in $(UNITS); do \
		sed 's|/usr/bin/charly-arbiter|$(BINDIR)/charly-arbiter|g' $$unit \
			> $(DESTDIR)$(UNITDIR)/$$(basename $$unit) && \
		chmod 0644 $(DESTDIR)$(UNITDIR)/$$(basename $$unit) || exit 1; \
	done
	install -m 0644 etc/tmpfiles.d/charly-arbiter.conf $(DESTDIR)$(TMPFILESDIR)/charly-arbiter.conf
	install -d -m 0755 $(DESTDIR)$(MANDIR)/man8
	install -m 0644 $(BUILDDIR)/man/*.8 $(DESTDIR)$(MANDIR)/man8/
	install -d -m 0755 $(DESTDIR)$(BASHCOMPDIR) $(DESTDIR)$(ZSHCOMPDIR) $(DESTDIR)$(FISHCOMPDIR)
	install -m 0644 $(BUILDDIR)/completions/$(NAME).bash $(DESTDIR)$(BASHCOMPDIR)/$(NAME)
	install -m 0644 $(BUILDDIR)/completions/_$(NAME) $(DESTDIR)$(ZSHCOMPDIR)/_$(NAME)
	install -m 0644 $(BUILDDIR)/completions/$(NAME).fish $(DESTDIR)$(FISHCOMPDIR)/$(NAME).fish
	install -d -m 0755 $(DESTDIR)$(PKGDATADIR)/prometheus $(DESTDIR)$(PKGDATADIR)/grafana
	install -m 0644 etc/prometheus/$(NAME).rules.yml $(DESTDIR)$(PKGDATADIR)/prometheus/
	install -m 0644 etc/grafana/$(NAME).json $(DESTDIR)$(PKGDATADIR)/grafana/

# The GPUs page: plain files, no build step (docs/cockpit.md says why).
install-cockpit:
	install -d -m 0755 $(DESTDIR)$(COCKPITDIR)
	install -m 0644 $(COCKPIT_FILES) $(DESTDIR)$(COCKPITDIR)/

install-docs:
	install -d -m 0755 $(DESTDIR)$(DOCDIR)
	install -m 0644 README.md docs/*.md $(DESTDIR)$(DOCDIR)/
	install -d -m 0755 $(DESTDIR)$(DOCDIR)/examples
	install -m 0644 etc/charly-arbiter/domain-metadata.xml etc/charly-arbiter/drains.toml \
		$(DESTDIR)$(DOCDIR)/examples/

# The source tree as git sees it (tracked and new, not ignored files), as a tarball.
sources:
	mkdir -p $(BUILDDIR)
	git ls-files -z --cached --others --exclude-standard \
		| tar --null --files-from=- --ignore-failed-read --transform 's,^,$(NAME)-$(VERSION)/,' \
			--sort=name --owner=0 --group=0 --numeric-owner -czf $(BUILDDIR)/$(NAME)-$(VERSION).tar.gz

deb: sources
	@test "$$(dpkg-parsechangelog -l packaging/debian/changelog -S Version)" = "$(VERSION)" \
		|| { echo "packaging/debian/changelog is not at version $(VERSION)" >&2; exit 1; }
	rm -rf $(BUILDDIR)/deb && mkdir -p $(BUILDDIR)/deb $(DISTDIR)
	tar -xzf $(BUILDDIR)/$(NAME)-$(VERSION).tar.gz -C $(BUILDDIR)/deb
	cp -a packaging/debian $(BUILDDIR)/deb/$(NAME)-$(VERSION)/debian
	cd $(BUILDDIR)/deb/$(NAME)-$(VERSION) && env PATH=$(CLEAN_PATH) dpkg-buildpackage -b -us -uc
	cp $(BUILDDIR)/deb/$(NAME)_$(VERSION)_all.deb $(BUILDDIR)/deb/cockpit-$(NAME)_$(VERSION)_all.deb \
		$(DISTDIR)/

lintian:
	lintian --fail-on error,warning --info $(DISTDIR)/$(NAME)_$(VERSION)_all.deb \
		$(DISTDIR)/cockpit-$(NAME)_$(VERSION)_all.deb

rpm-srpm: sources
	rm -rf $(BUILDDIR)/rpm && mkdir -p $(BUILDDIR)/rpm/SOURCES $(DISTDIR)
	cp $(BUILDDIR)/$(NAME)-$(VERSION).tar.gz $(BUILDDIR)/rpm/SOURCES/
	rpmbuild -bs --define "_topdir $(abspath $(BUILDDIR))/rpm" packaging/rpm/$(NAME).spec
	cp $(BUILDDIR)/rpm/SRPMS/$(NAME)-$(VERSION)-*.src.rpm $(DISTDIR)/

rpm-spec-check:
	rpmspec -P packaging/rpm/$(NAME).spec >/dev/null

clean:
	rm -rf $(BUILDDIR)/man $(BUILDDIR)/completions $(BUILDDIR)/wheel $(BUILDDIR)/deb \
		$(BUILDDIR)/rpm $(BUILDDIR)/$(NAME)-*.tar.gz $(DISTDIR)

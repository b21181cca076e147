# dlcp: install the Python package and the dlcpd systemd service (docs/operations.md).
#
#   sudo make install                        # pip install ., unit, sysusers, tmpfiles, config
#   sudo make install PYTHON=/opt/dlcp/bin/python   # into a virtualenv (recommended)
#   sudo make uninstall                      # keeps /etc/dlcp/dlcpd.toml and the dlcp user
#   make install-systemd DESTDIR=/tmp/stage DLCPD=/usr/bin/dlcpd   # staging, for packagers
#
# Variables:
#   PYTHON      interpreter whose pip installs dlcp (default python3)
#   PIP_FLAGS   extra pip flags, e.g. --break-system-packages for Debian's own python3
#   DLCPD       path of the installed dlcpd; default: the scripts dir of PYTHON
#   PREFIX      where the unit, sysusers.d and tmpfiles.d snippets go (default /usr/local)
#   DESTDIR     staging root for the files; with it nothing is activated

PYTHON ?= python3
PIP_FLAGS ?=
PREFIX ?= /usr/local
DESTDIR ?=
BINDIR ?= $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)
DLCPD ?= $(BINDIR)/dlcpd
UNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
CONFDIR := /etc/dlcp
# The path written in systemd/dlcpd.service, replaced by $(DLCPD) on install.
UNIT_DLCPD := /usr/local/bin/dlcpd

INSTALL ?= install
SYSTEMD_RUNNING := $(shell test -d /run/systemd/system && echo yes)

# install-python, install-systemd and activate must run in this order
.NOTPARALLEL:

.PHONY: help install install-python install-systemd activate \
	uninstall uninstall-systemd uninstall-python test

help:
	@sed -n '2,14s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))

install: install-python install-systemd activate
	@echo "dlcpd installed ($(DLCPD)). Edit $(CONFDIR)/dlcpd.toml, then:"
	@echo "  systemctl enable --now dlcpd"
	@echo "  usermod -aG dlcp USER    # for each user whose ranks use dlcp"

install-python:
	$(PYTHON) -m pip install $(PIP_FLAGS) .
	@test -x "$(DLCPD)" || { echo "error: $(DLCPD) is missing after pip install;" \
		"pass DLCPD=/path/to/dlcpd" >&2; exit 1; }

install-systemd:
	@case "$(DLCPD)" in \
		/*) ;; \
		*) echo "error: DLCPD must be an absolute path, got '$(DLCPD)'" >&2; exit 1 ;; \
	esac
	@case "$(DLCPD)" in \
		/home/*|/root/*|/run/user/*) echo "warning: $(DLCPD) lies under a home" \
			"directory, which the unit's ProtectHome=yes hides from dlcpd" >&2 ;; \
	esac
	$(INSTALL) -d "$(DESTDIR)$(UNITDIR)" "$(DESTDIR)$(SYSUSERSDIR)" \
		"$(DESTDIR)$(TMPFILESDIR)" "$(DESTDIR)$(CONFDIR)"
	sed 's#$(UNIT_DLCPD)#$(DLCPD)#g' systemd/dlcpd.service > "$(DESTDIR)$(UNITDIR)/dlcpd.service.tmp"
	chmod 0644 "$(DESTDIR)$(UNITDIR)/dlcpd.service.tmp"
	mv -f "$(DESTDIR)$(UNITDIR)/dlcpd.service.tmp" "$(DESTDIR)$(UNITDIR)/dlcpd.service"
	$(INSTALL) -m 0644 systemd/dlcp.sysusers.conf "$(DESTDIR)$(SYSUSERSDIR)/dlcp.conf"
	$(INSTALL) -m 0644 systemd/dlcp.tmpfiles.conf "$(DESTDIR)$(TMPFILESDIR)/dlcp.conf"
	@if [ -e "$(DESTDIR)$(CONFDIR)/dlcpd.toml" ]; then \
		echo "keeping $(DESTDIR)$(CONFDIR)/dlcpd.toml (example: systemd/dlcpd.toml)"; \
	else \
		echo "$(INSTALL) -m 0644 systemd/dlcpd.toml $(DESTDIR)$(CONFDIR)/dlcpd.toml"; \
		$(INSTALL) -m 0644 systemd/dlcpd.toml "$(DESTDIR)$(CONFDIR)/dlcpd.toml"; \
	fi

# Create the user and /run/dlcp, and let systemd see the unit (skipped with DESTDIR).
activate:
ifeq ($(DESTDIR),)
	systemd-sysusers "$(SYSUSERSDIR)/dlcp.conf"
	systemd-tmpfiles --create "$(TMPFILESDIR)/dlcp.conf"
ifeq ($(SYSTEMD_RUNNING),yes)
	systemctl daemon-reload
else
	@echo "systemd is not running here: skipping systemctl daemon-reload"
endif
else
	@echo "DESTDIR is set: not creating the dlcp user nor reloading systemd"
endif

uninstall: uninstall-systemd uninstall-python
	@echo "kept $(CONFDIR)/dlcpd.toml and the dlcp user; remove them by hand if unwanted"

uninstall-systemd:
ifeq ($(DESTDIR)$(SYSTEMD_RUNNING),yes)
	-systemctl disable --now dlcpd.service
endif
	rm -f "$(DESTDIR)$(UNITDIR)/dlcpd.service" "$(DESTDIR)$(SYSUSERSDIR)/dlcp.conf" \
		"$(DESTDIR)$(TMPFILESDIR)/dlcp.conf"
ifeq ($(DESTDIR)$(SYSTEMD_RUNNING),yes)
	systemctl daemon-reload
endif

uninstall-python:
ifeq ($(DESTDIR),)
	$(PYTHON) -m pip uninstall -y $(filter --break-system-packages,$(PIP_FLAGS)) dlcp
endif

test:
	bash scripts/test

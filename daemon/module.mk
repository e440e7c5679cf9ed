# daemon/: diffragd (sockets, protocol, broker, workers, configuration, metrics) and its
# installation. Needs libzmq, msgpack-c, libmicrohttpd, libsystemd and libcrypto (OpenSSL)
# (tools/install-deps.sh).
# main.c and startup.c are the binary's own; the rest is the library the tests link too.
DAEMON_MAIN_SRCS := daemon/main.c daemon/startup.c
DAEMON_MAIN_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(DAEMON_MAIN_SRCS))
DAEMON_SRCS := $(filter-out $(DAEMON_MAIN_SRCS),$(wildcard daemon/*.c))
DAEMON_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(DAEMON_SRCS))
LIB_DAEMON  := $(BUILD)/libdiffrag_daemon.a
DAEMON_LIBS := $(LIB_DAEMON) -lzmq -lmsgpackc -lmicrohttpd -lsystemd -lcrypto

$(LIB_DAEMON): $(DAEMON_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

BINS += $(BUILD)/diffragd
$(BUILD)/diffragd: $(DAEMON_MAIN_OBJS) $(LIB_DAEMON) $(LIB_RETRIEVER) $(LIB_MODEL)
	$(CC) $(LDFLAGS) $(DAEMON_MAIN_OBJS) -o $@ $(DAEMON_LIBS) $(RETRIEVER_LIBS) $(MODEL_LIBS) $(LDLIBS)

# The daemon's C unit tests link the daemon library too (the generic test rule does not).
$(BUILD)/tests/test_daemon_units $(BUILD)/tests/test_grounding_units: $(BUILD)/tests/%: \
        $(BUILD)/tests/%.o $(LIB_DAEMON) $(LIB_RETRIEVER) $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(DAEMON_LIBS) $(RETRIEVER_LIBS) $(MODEL_LIBS) $(LDLIBS)

bench-daemon: $(BUILD)/diffragd venv
	$(VENV_PATH) $(PYTHON) bench/bench_daemon.py

# `make soak`: 64 clients for SOAK_SECONDS (after a 30 s warm-up) against a tiny model; fails on
# a lost, duplicated or misdirected reply, a broken queue bound, counts that differ from
# /metrics, or resident memory growing more than 5% (bench/soak.py). BUILD=build/asan soaks the
# sanitized daemon.
SOAK_SECONDS ?= 120
soak: $(BUILD)/diffragd venv
	BUILD=$(BUILD) $(VENV_PATH) $(PYTHON) bench/soak.py --seconds $(SOAK_SECONDS) --clients 64 \
	    --json $(BUILD)/soak.json

# `make install-daemon PREFIX=/usr DESTDIR=...`: the binary, the configuration (kept when one
# exists), the systemd unit, the documentation, the groundedness calibrations (found by
# grounding_calibration = auto in PREFIX/share/diffrag/grounding) and (INSTALL_MODEL=yes) the
# default model, with the unit's and the configuration's paths pointed at PREFIX.
PREFIX        ?= /usr/local
SYSCONFDIR    ?= /etc
UNITDIR       ?= $(PREFIX)/lib/systemd/system
INSTALL_MODEL ?= yes
DAEMON_SHARE  := $(PREFIX)/share/diffrag
install-daemon: $(BUILD)/diffragd $(CUDA_LIB)
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(SYSCONFDIR)/diffrag $(DESTDIR)$(UNITDIR) \
	    $(DESTDIR)$(PREFIX)/share/doc/diffrag $(DESTDIR)$(DAEMON_SHARE)/models \
	    $(DESTDIR)$(DAEMON_SHARE)/grounding
	install -m 755 $(BUILD)/diffragd $(DESTDIR)$(PREFIX)/bin/diffragd
	sed 's|/usr/local/share/diffrag|$(DAEMON_SHARE)|g' deploy/diffragd.conf > \
	    $(DESTDIR)$(SYSCONFDIR)/diffrag/diffragd.conf.example
	test -e $(DESTDIR)$(SYSCONFDIR)/diffrag/diffragd.conf || \
	    cp $(DESTDIR)$(SYSCONFDIR)/diffrag/diffragd.conf.example $(DESTDIR)$(SYSCONFDIR)/diffrag/diffragd.conf
	sed -e 's|/usr/local/bin/diffragd|$(PREFIX)/bin/diffragd|g' \
	    -e 's|/usr/local/share/doc/diffrag|$(PREFIX)/share/doc/diffrag|g' \
	    -e 's|/etc/diffrag/|$(SYSCONFDIR)/diffrag/|g' deploy/diffragd.service > \
	    $(DESTDIR)$(UNITDIR)/diffragd.service
	chmod 644 $(DESTDIR)$(UNITDIR)/diffragd.service
	install -m 644 docs/protocol.md docs/configuration.md docs/groundedness.md \
	    $(DESTDIR)$(PREFIX)/share/doc/diffrag/
	for f in deploy/grounding/*.grounding; do \
	    if [ -f "$$f" ]; then install -m 644 "$$f" $(DESTDIR)$(DAEMON_SHARE)/grounding/ || exit 1; fi; \
	done
	if [ "$(INSTALL_MODEL)" = yes ] && [ -f $(QWEN_FILE) ]; then \
	    install -m 644 $(QWEN_FILE) $(DESTDIR)$(DAEMON_SHARE)/models/; fi
	$(if $(CUDA_LIB),install -d $(DESTDIR)$(PREFIX)/lib && \
	    install -m 755 $(CUDA_LIB) $(DESTDIR)$(PREFIX)/lib/libdiffrag_cuda.so)

.PHONY: bench-daemon install-daemon soak

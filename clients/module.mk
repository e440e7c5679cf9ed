# clients/: libdiffrag (the C client: $(BUILD)/libdiffrag.a and .so, one header, diffrag.pc),
# the `diffrag` command line, diffrag-extract, the C example and the C client test, and
# `make install-clients`.
# They speak only the wire protocol and need libzmq and msgpack-c, nothing else of diffrag.
CLIENT_VERSION := 0.1.0
CLIENT_SONAME  := libdiffrag.so.0
CLIENT_SRCS    := $(wildcard clients/c/*.c) $(TEXT_SRCS)
CLIENT_OBJS    := $(patsubst %.c,$(BUILD)/%.o,$(CLIENT_SRCS))
CLIENT_PIC     := $(patsubst %.c,$(BUILD)/pic/%.o,$(CLIENT_SRCS))
CLIENT_EXT     := -lzmq -lmsgpackc -ljansson
LIB_CLIENT     := $(BUILD)/libdiffrag.a
SO_CLIENT      := $(BUILD)/libdiffrag.so
CLI_OBJS       := $(patsubst %.c,$(BUILD)/%.o,$(wildcard clients/cli/*.c))
# Documents from local files: shared by `diffrag ingest` and `diffrag-store ingest`.
DOCSRC_OBJS    := $(patsubst %.c,$(BUILD)/%.o,$(wildcard clients/ingest/*.c))

# Only the diffrag_* API leaves the libraries: the rest is hidden from the dynamic symbol
# table (.so) and made local in the one relocatable object the archive holds (.a), so the
# library's internal names never clash with a program's.
$(CLIENT_OBJS) $(CLIENT_PIC): CFLAGS += -fvisibility=hidden
$(BUILD)/pic/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fPIC -c $< -o $@

$(SO_CLIENT): $(CLIENT_PIC)
	$(CC) $(LDFLAGS) -shared -Wl,-soname,$(CLIENT_SONAME) $^ -o $@ $(CLIENT_EXT) $(LDLIBS)

$(LIB_CLIENT): $(CLIENT_OBJS)
	$(LD) -r $^ -o $(BUILD)/libdiffrag-all.o
	objcopy --localize-hidden $(BUILD)/libdiffrag-all.o
	rm -f $@ && ar rcs $@ $(BUILD)/libdiffrag-all.o

# The command line and the tests use the objects themselves (the JSON helpers are internal).
BINS += $(BUILD)/diffrag $(SO_CLIENT) $(LIB_CLIENT) $(BUILD)/examples/ask_folder
$(BUILD)/diffrag: $(CLI_OBJS) $(DOCSRC_OBJS) $(CLIENT_OBJS)
	$(CC) $(LDFLAGS) $^ -o $@ $(CLIENT_EXT) $(LDLIBS)

# The example is written as a user's program would be: #include <diffrag.h>, -ldiffrag.
$(BUILD)/examples/ask_folder.o: CFLAGS += -Iclients/c
$(BUILD)/examples/ask_folder: $(BUILD)/examples/ask_folder.o $(LIB_CLIENT)
	$(CC) $(LDFLAGS) $< -o $@ $(LIB_CLIENT) $(CLIENT_EXT) $(LDLIBS)

# diffrag-extract: PDF, DOCX and HTML to Markdown for the ingest (docs/cli.md), in a process of
# its own under rlimits and a seccomp filter. It links gumbo, libzip, libxml2 and libseccomp;
# PDF text comes from poppler's pdftotext, run as a program, never linked.
EXTRACT_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard clients/extract/*.c) text/docformat.c)
$(BUILD)/clients/extract/docx.o: CFLAGS += $(shell pkg-config --cflags libxml-2.0)
BINS += $(BUILD)/diffrag-extract
$(BUILD)/diffrag-extract: $(EXTRACT_OBJS)
	$(CC) $(LDFLAGS) $^ -o $@ -lgumbo -lzip -lxml2 -lseccomp $(LDLIBS)

# The C client test (run by tests/test_c_units.py without a daemon, and by
# tests/test_clients_c.py against one) links the client, not the engine libraries.
$(BUILD)/tests/test_client_c: $(BUILD)/tests/test_client_c.o $(CLIENT_OBJS)
	$(CC) $(LDFLAGS) $^ -o $@ $(CLIENT_EXT) $(LDLIBS)

# `make install-clients PREFIX=/usr DESTDIR=...`: the header, both libraries, diffrag.pc and
# the command line. Libraries of a sanitizer build need its runtime in every program that links
# them: diffrag.pc then carries the -fsanitize flags.
PREFIX       ?= /usr/local
LIBDIR       ?= $(PREFIX)/lib
INCLUDEDIR   ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
install-clients: $(LIB_CLIENT) $(SO_CLIENT) $(BUILD)/diffrag $(BUILD)/diffrag-extract
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) \
	    $(DESTDIR)$(PKGCONFIGDIR)
	install -m 644 clients/c/diffrag.h $(DESTDIR)$(INCLUDEDIR)/diffrag.h
	install -m 644 $(LIB_CLIENT) $(DESTDIR)$(LIBDIR)/libdiffrag.a
	install -m 755 $(SO_CLIENT) $(DESTDIR)$(LIBDIR)/libdiffrag.so.$(CLIENT_VERSION)
	ln -sf libdiffrag.so.$(CLIENT_VERSION) $(DESTDIR)$(LIBDIR)/$(CLIENT_SONAME)
	ln -sf $(CLIENT_SONAME) $(DESTDIR)$(LIBDIR)/libdiffrag.so
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(LIBDIR)|' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|' \
	    -e 's|@VERSION@|$(CLIENT_VERSION)|' -e 's|@SAN@|$(if $(SAN), $(SAN))|' clients/c/diffrag.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/diffrag.pc
	chmod 644 $(DESTDIR)$(PKGCONFIGDIR)/diffrag.pc
	install -m 755 $(BUILD)/diffrag $(DESTDIR)$(PREFIX)/bin/diffrag
	install -m 755 $(BUILD)/diffrag-extract $(DESTDIR)$(PREFIX)/bin/diffrag-extract

.PHONY: install-clients

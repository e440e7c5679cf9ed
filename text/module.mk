# text/: the bottom layer (UTF-8, Unicode tables, word splitting, JSON, hashing, the token
# counting interface). Everything above links it; it includes nothing of diffrag's above it.
# JSON comes from jansson (Debian's libjansson-dev).
TEXT_SRCS := $(wildcard text/*.c)
TEXT_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(TEXT_SRCS))
LIB_TEXT  := $(BUILD)/libdiffrag_text.a
TEXT_LIBS := $(LIB_TEXT) -ljansson

$(LIB_TEXT): $(TEXT_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^
BINS += $(LIB_TEXT)

/* What diffragd's two HTTP listeners (the metrics endpoint, metrics.c, and the OpenAI-compatible
 * API, openai.c) share over libmicrohttpd: binding HOST:PORT with errors that name their cause,
 * a guard that keeps slow clients from holding the listener, and strict request framing
 * (http_framing.c).
 *
 * The guard tracks every connection. Each gets a deadline for its whole request (not only an
 * idle timeout, which bytes trickled in every few seconds keep resetting), and at a limit a new
 * connection takes the place of the one that has waited longest without finishing a request,
 * first of its own IP address, then of all, instead of being refused. A client that sends its
 * request at once is served; a slowloris holds nothing for long. A connection whose request is
 * being answered (http_guard_busy) is exempt from that deadline and is never displaced; but at
 * most max_open - reserved connections may be busy at once, so the reserved ones always take
 * new requests, and a busy connection whose client reads nothing of its answer for the deadline
 * (its kernel send queue full, nothing acknowledged) is closed. A connection that finds every
 * slot busy is not closed unanswered: http_guard_refused tells the handler to answer it 503. */
#ifndef DIFFRAG_HTTP_H
#define DIFFRAG_HTTP_H

#include <stddef.h>

#include <microhttpd.h>

#define HTTP_LISTEN_BACKLOG 1024   /* a burst of connects waits in the kernel, not dropped */

/* Binds and listens on "HOST:PORT" (an IPv4 or IPv6 literal, or "localhost"). key names the
 * setting in errors. *fd receives the socket; *mhd_flags gets MHD_USE_IPv6 for an IPv6
 * address. 0, or -1 with err. */
int http_bind(const char *key, const char *hostport, int *fd, unsigned *mhd_flags, char *err,
              size_t errlen);

struct HttpGuard;

/* max_open: connections open at once; max_per_ip: of them, from one address; reserved: of
 * max_open, the connections that may not be busy (0 .. max_open - 1); deadline_s: the time
 * from a connection's accept (or the end of its last request) to the end of its next one, and
 * the longest a busy connection's client may read nothing of its answer. Starts the sweeper
 * thread. 0, or -1 with err. */
int http_guard_new(int max_open, int max_per_ip, int reserved, double deadline_s,
                   struct HttpGuard **out, char *err, size_t errlen);
/* The connection limit to give libmicrohttpd (MHD_OPTION_CONNECTION_LIMIT): room for the open
 * connections and as many dropped or refused ones the server has not reaped yet. */
unsigned http_guard_slots(const struct HttpGuard *g);
/* Register as MHD_OPTION_NOTIFY_CONNECTION with the guard as its closure. */
void http_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                       enum MHD_ConnectionNotificationCode toe);
/* Call from the MHD_OPTION_NOTIFY_COMPLETED callback: the next request on the connection gets
 * a fresh deadline, and the connection is no longer busy. */
void http_guard_request_done(struct HttpGuard *g, struct MHD_Connection *c);
/* The connection's request is complete and about to be answered: exempt from its deadline and
 * from being dropped for a new connection until http_guard_request_done. 0; -1 when
 * max_open - reserved connections are busy already: the request is not taken (answer 503). */
int http_guard_busy(struct HttpGuard *g, struct MHD_Connection *c);
/* 1 when the connection came while every slot was busy: answer its request 503 and close. */
int http_guard_refused(struct HttpGuard *g, struct MHD_Connection *c);
/* Connections open now (for a gauge). */
int http_guard_open(struct HttpGuard *g);
/* Stops the sweeper. Call after MHD_stop_daemon. NULL is a no-op; *g becomes NULL. */
void http_guard_destroy(struct HttpGuard **g);

/* ---- strict framing (http_framing.c) ---- */

/* Checks the framing of a request whose headers libmicrohttpd has just parsed (call on the
 * first call of the access handler, with its method and version), as RFC 9112 asks of a server
 * and beyond what libmicrohttpd 0.9.75 checks: one Host header in an HTTP/1.1 request; at most
 * one Content-Length; never Content-Length with Transfer-Encoding; Transfer-Encoding only
 * `chunked`, and only in HTTP/1.1; no NUL byte in the request line or a header field; lines
 * ending in CRLF. 0 when it holds; otherwise the status to answer (400, or 501 for a transfer
 * coding other than chunked) with why in msg. Answer it with `Connection: close`: the rest of
 * the bytes cannot be trusted to frame another request. */
unsigned http_framing_check(struct MHD_Connection *c, const char *method, const char *version,
                            char *msg, size_t cap);

#endif

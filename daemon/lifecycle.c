/* The broker's life with its supervisor: the gauges, sd_notify (READY after a reload, STATUS,
 * RELOADING, STOPPING), the SIGHUP reload of the configuration and the key files, and the
 * SIGTERM drain (refuse new work, finish what is in flight, then cancel and give up). */
#include "daemon/broker_internal.h"

#include <stdio.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "daemon/log.h"
#include "daemon/zap.h"
#include "daemon/zutil.h"

void lifecycle_update_gauges(struct Broker *b)
{
    if (!b->gauges_dirty)
        return;
    metrics_gauges(b->o.metrics, b->n_wait, b->n_live, b->n_workers - b->n_busy, b->n_busy,
                   b->n_running, workers_kv_bytes(b));
    b->gauges_dirty = 0;
}

void lifecycle_notify_status(struct Broker *b, double now, int force)
{
    if (!force && now < b->next_status)
        return;
    b->next_status = now + 1000;
    char s[160];
    snprintf(s, sizeof s, "STATUS=%s: %d workers (%d busy), %d queued, %d in flight",
             b->draining ? "draining" : b->ready_sent ? "serving" : "starting", b->n_workers,
             b->n_busy, b->n_wait, b->n_live);
    if (force || strcmp(s, b->last_status)) {
        sd_notify(0, s);
        snprintf(b->last_status, sizeof b->last_status, "%s", s);
    }
}

/* The allowed client keys are re-read on every SIGHUP, so a key file edited in place (a key
 * added or revoked) takes effect without a restart. A file that does not load leaves the
 * keys in force. */
static void reload_keys(struct Broker *b)
{
    if (!b->o.zap)
        return;
    struct ZapKeys *keys = NULL;
    size_t n = 0;
    char err[512];
    if (b->cfg->curve_allowed_keys[0] &&
        zap_keys_load(b->cfg->curve_allowed_keys, &keys, &n, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"allowed client keys not reloaded; the previous ones stay\" error=\"%s\"",
             err);
    } else {
        zap_set_keys(b->o.zap, 0, &keys);
        if (b->cfg->curve_allowed_keys[0])
            dlog(LL_INFO, "msg=\"allowed client keys reloaded\" keys=%zu", n);
        else
            dlog(LL_WARN, "msg=\"curve_allowed_keys is empty: any client with the daemon's public "
                 "key may connect\"");
    }
    if (!b->cfg->worker_listen[0])
        return;
    if (!b->cfg->curve_worker_keys[0] ||
        zap_keys_load(b->cfg->curve_worker_keys, &keys, &n, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"worker keys not reloaded; the previous ones stay\" error=\"%s\"",
             b->cfg->curve_worker_keys[0] ? err : "curve_worker_keys is empty");
        return;
    }
    zap_set_keys(b->o.zap, 1, &keys);
    dlog(LL_INFO, "msg=\"worker keys reloaded\" keys=%zu", n);
}

void lifecycle_reload(struct Broker *b)
{
    char changed[512], ignored[512], err[512];
    sd_notify(0, "RELOADING=1\nSTATUS=reloading the configuration");
    if (config_reload(b->cfg, b->o.argc, b->o.argv, changed, sizeof changed, ignored,
                      sizeof ignored, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"reload failed; the configuration is unchanged\" error=\"%s\"", err);
    } else {
        dlog_level = dlog_level_parse(b->cfg->log_level);
        int64_t maxmsg = (int64_t)b->cfg->max_message_bytes * 4 + 65536;
        zmq_setsockopt(b->front, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
        reload_keys(b);
        dlog(LL_INFO, "msg=\"configuration reloaded\" changed=\"%s\" needs_restart=\"%s\"", changed,
             ignored);
    }
    sd_notify(0, "READY=1");
    lifecycle_notify_status(b, zu_now_ms(), 1);
}

void lifecycle_start_drain(struct Broker *b, double now)
{
    b->draining = 1;
    b->drain_deadline = now + b->cfg->drain_timeout * 1e3;
    metrics_set_draining(b->o.metrics);
    sd_notify(0, "STOPPING=1");
    dlog(LL_INFO, "msg=\"draining\" inflight=%d drain_timeout_s=%g", b->n_live, b->cfg->drain_timeout);
    lifecycle_notify_status(b, now, 1);
}

/* Running requests' replies still come (finish_reason "cancelled"); a little later, what is
 * left gets an error (lifecycle_give_up_running). */
void lifecycle_force_drain(struct Broker *b, double now)
{
    b->drain_forced = 1;
    b->hard_deadline = now + 2000 + (double)b->cfg->heartbeat_ms;
    struct Request *r = b->all.next;
    while (r != &b->all) {
        struct Request *next = r->next;
        if (r->state == RS_PREP_WAIT || r->state == RS_WAIT) {
            request_unqueue(b, r);
            reply_error(b, r, EC_SHUTTING_DOWN, "the daemon is shutting down");
        } else if (r->state == RS_RUN) {
            workers_cancel(b, r, WIRE_REASON_SHUTDOWN);
        }
        r = next;
    }
}

void lifecycle_give_up_running(struct Broker *b)
{
    struct Request *r = b->all.next;
    while (r != &b->all) {
        struct Request *next = r->next;
        if (r->state == RS_RUN) {
            workers_detach(b, r);
            reply_error(b, r, EC_SHUTTING_DOWN, "the daemon is shutting down");
        }
        r = next;
    }
}

/* A client request while diffragd holds it: the message (which the decoded parameters borrow),
 * the client's envelope, where it is in the pipeline, its timings, and what the retrieval
 * stage produced. The broker thread owns it, except while an I/O thread runs its retrieval or
 * store operation: then only that thread touches the prep fields, until it hands it back. */
#ifndef DIFFRAG_REQUEST_H
#define DIFFRAG_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include <zmq.h>

#include "daemon/grounding.h"
#include "daemon/mp.h"
#include "daemon/proto.h"
#include "retriever/planner.h"

#define REQ_MAX_IDENT 256

enum ReqState {
    RS_PREP_WAIT,  /* waiting for an I/O thread */
    RS_PREP,       /* an I/O thread is retrieving / running the store operation */
    RS_WAIT,       /* retrieved; waiting for an idle worker */
    RS_RUN,        /* a worker is generating */
};

struct WorkerRef;

struct Request {
    struct Request *prev, *next;      /* every live request (broker) */
    struct Request *qnext;            /* the queue it waits in */
    zmq_msg_t body;                   /* the request bytes */
    void *sock;                       /* the client socket it came on (the broker's front or
                                         HTTP gateway socket), which its replies go to */
    uint8_t ident[REQ_MAX_IDENT];     /* client routing id */
    size_t ident_len;
    int req_envelope;                 /* REQ client: an empty delimiter frame; no streaming */
    struct RequestParams p;
    enum ReqState state;
    /* copied from the configuration at admission, so a reload cannot race the I/O thread */
    long chunk_tokens, chunk_overlap;
    long extract_timeout_ms;
    /* times (ms, monotonic) */
    double t_recv, t_dispatch, deadline;
    /* filled by the I/O thread */
    double retrieve_ms;
    struct Context *ctx;              /* query: the assembled prompt */
    struct WordSet *doc_words;        /* query: the placed chunks' words (lexical support) */
    struct PlanRead read;             /* query: what of the documents the prompt holds */
    struct MpWriter reply;            /* store operations: the reply body after id/ok */
    size_t reply_fields;              /* entries in `reply` (a map body) */
    enum ErrCode code;
    char message[512];
    /* the broker's */
    int cancelled, deadline_hit, retried, streamed;
    uint64_t job;
    struct WorkerRef *worker;
};

#endif

/* The I/O stages of the ops (stages.c), which the op table (ops.c) names and an I/O thread
 * runs: each fills r->reply and r->reply_fields (a store op: the reply's fields after id and
 * ok), or r->ctx and r->doc_words (a query), or sets r->code and r->message. */
#ifndef DIFFRAG_STAGES_H
#define DIFFRAG_STAGES_H

#include "daemon/prep.h"
#include "daemon/request.h"

void stage_query(const struct PrepShared *sh, struct Request *r);
void stage_ingest(const struct PrepShared *sh, struct Request *r);
void stage_delete(const struct PrepShared *sh, struct Request *r);
void stage_drop(const struct PrepShared *sh, struct Request *r);
void stage_get(const struct PrepShared *sh, struct Request *r);
void stage_list(const struct PrepShared *sh, struct Request *r);
void stage_stats(const struct PrepShared *sh, struct Request *r);

#endif

/* The op table's rows: each op's name, decoder, stage and I/O handler, in enum Op order.
 * Everything that differs between ops is reached from here, so no other file of the daemon
 * switches over the ops. */
#include "daemon/ops.h"

#include <string.h>

#include "daemon/stages.h"

static const struct OpDef OPS[OP_NONE] = {
    [OP_PING]   = { "ping",   proto_decode_ping,   OPS_LOOP,  0, NULL },
    [OP_QUERY]  = { "query",  proto_decode_query,  OPS_QUERY, 0, stage_query },
    [OP_INGEST] = { "ingest", proto_decode_ingest, OPS_WRITE, 0, stage_ingest },
    [OP_DELETE] = { "delete", proto_decode_delete, OPS_WRITE, 0, stage_delete },
    [OP_DROP]   = { "drop",   proto_decode_drop,   OPS_WRITE, 0, stage_drop },
    [OP_GET]    = { "get",    proto_decode_get,    OPS_READ,  0, stage_get },
    [OP_LIST]   = { "list",   proto_decode_list,   OPS_READ,  0, stage_list },
    [OP_STATS]  = { "stats",  proto_decode_stats,  OPS_READ,  1, stage_stats },
    [OP_CANCEL] = { "cancel", proto_decode_cancel, OPS_LOOP,  0, NULL },
};

const struct OpDef *ops_get(enum Op op)
{
    return (unsigned)op < OP_NONE ? &OPS[op] : NULL;
}

const char *op_name(enum Op op)
{
    const struct OpDef *o = ops_get(op);
    return o ? o->name : "none";
}

enum Op ops_find(const char *name, size_t len)
{
    for (int i = 0; i < OP_NONE; i++)
        if (strlen(OPS[i].name) == len && !memcmp(OPS[i].name, name, len))
            return (enum Op)i;
    return OP_NONE;
}

enum OpStage ops_stage(const struct RequestParams *p)
{
    const struct OpDef *o = ops_get(p->op);
    if (!o || (o->loop_without_collection && p->collection.len == 0))
        return OPS_LOOP;
    return o->stage;
}

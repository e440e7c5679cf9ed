/* The endpoint checks of the configuration: tcp://HOST:PORT for ZeroMQ (a port in 1..65535;
 * a bind address this machine has, or an interface name), HOST:PORT for the metrics server,
 * and whether an endpoint is loopback (by address, or an interface flagged loopback). */
#include "daemon/config.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- endpoints: tcp://HOST:PORT for ZeroMQ, HOST:PORT for the metrics server ---- */

/* Splits HOST:PORT at its last colon: host without IPv6 brackets into host[], the port text
 * into *port_text. 0, or -1 when there is no colon, no host or the brackets do not close. */
static int split_hostport(const char *hp, char *host, size_t cap, const char **port_text)
{
    const char *colon = strrchr(hp, ':');
    if (!colon || colon == hp)
        return -1;
    const char *h = hp;
    size_t n = (size_t)(colon - hp);
    if (h[0] == '[') {
        if (n < 3 || h[n - 1] != ']')
            return -1;
        h++;
        n -= 2;
    }
    if (n >= cap)
        return -1;
    memcpy(host, h, n);
    host[n] = 0;
    *port_text = colon + 1;
    return 0;
}

/* 1..65535 in decimal digits, or -1 (0 and * would choose a port nobody can be told). */
static long parse_port(const char *t)
{
    long v = 0;
    if (!*t || strlen(t) > 5)
        return -1;
    for (; *t; t++) {
        if (!isdigit((unsigned char)*t))
            return -1;
        v = v * 10 + (*t - '0');
    }
    return v >= 1 && v <= 65535 ? v : -1;
}

/* The interface named `name`: 1 when it has an IPv4 address (ZeroMQ binds that one), with
 * *loopback set from its flags; 0 when there is no such interface or it has no IPv4 address. */
static int interface_find(const char *name, int *loopback)
{
    struct ifaddrs *list, *a;
    int found = 0;
    *loopback = 0;
    if (getifaddrs(&list))
        return 0;
    for (a = list; a; a = a->ifa_next)
        if (a->ifa_name && !strcmp(a->ifa_name, name) && a->ifa_addr &&
            a->ifa_addr->sa_family == AF_INET) {
            found = 1;
            *loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
            break;
        }
    freeifaddrs(list);
    return found;
}

/* A host (no brackets) that only this machine can reach: 127.0.0.0/8, ::1, ::ffff:127.x, an
 * interface flagged loopback (lo), or localhost. */
static int host_loopback(const char *host)
{
    struct in_addr a4;
    struct in6_addr a6;
    int lo;
    if (!strcmp(host, "localhost"))
        return 1;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1)
        return IN6_IS_ADDR_LOOPBACK(&a6) ||
               (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
    return interface_find(host, &lo) && lo;
}

/* Whether this machine has the address: a bind to port 0 of it succeeds. Startup would fail
 * with "Cannot assign requested address" otherwise. */
static int address_bindable(int family, const void *addr)
{
    struct sockaddr_in s4;
    struct sockaddr_in6 s6;
    memset(&s4, 0, sizeof s4);
    memset(&s6, 0, sizeof s6);
    s4.sin_family = AF_INET;
    s6.sin6_family = AF_INET6;
    if (family == AF_INET)
        memcpy(&s4.sin_addr, addr, sizeof s4.sin_addr);
    else
        memcpy(&s6.sin6_addr, addr, sizeof s6.sin6_addr);
    int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    int ok = family == AF_INET ? bind(fd, (struct sockaddr *)&s4, sizeof s4) == 0
                               : bind(fd, (struct sockaddr *)&s6, sizeof s6) == 0;
    close(fd);
    return ok;
}

int config_check_zmq_endpoint(const char *key, const char *e, int bind_side, char *err,
                              size_t errlen)
{
    static const char *const schemes[] = { "tcp://", "ipc://", "inproc://", "ws://", "udp://" };
    size_t i;
    for (i = 0; i < sizeof schemes / sizeof schemes[0]; i++)
        if (!strncmp(e, schemes[i], strlen(schemes[i])) && e[strlen(schemes[i])])
            break;
    if (i == sizeof schemes / sizeof schemes[0]) {
        snprintf(err, errlen, "%s: \"%s\" is not a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH)",
                 key, e);
        return -1;
    }
    if (strncmp(e, "tcp://", 6))
        return 0;
    const char *hp = e + 6, *semi = strrchr(hp, ';'), *port_text;
    char host[256];
    if (!bind_side && semi)
        hp = semi + 1;   /* connect's tcp://SOURCE;HOST:PORT */
    if (split_hostport(hp, host, sizeof host, &port_text) || !host[0]) {
        snprintf(err, errlen, "%s: \"%s\" is not tcp://HOST:PORT", key, e);
        return -1;
    }
    if (parse_port(port_text) < 0) {
        snprintf(err, errlen, "%s: port \"%s\" of \"%s\" is not 1..65535", key, port_text, e);
        return -1;
    }
    if (!bind_side || !strcmp(host, "*"))
        return 0;
    unsigned char addr[sizeof(struct in6_addr)];
    int lo;
    if (inet_pton(AF_INET, host, addr) == 1 || inet_pton(AF_INET6, host, addr) == 1) {
        int family = strchr(host, ':') ? AF_INET6 : AF_INET;
        if (family == AF_INET6 && hp[0] != '[') {
            snprintf(err, errlen, "%s: put the IPv6 address of \"%s\" in brackets "
                     "(tcp://[%s]:%s)", key, e, host, port_text);
            return -1;
        }
        if (!address_bindable(family, addr)) {
            snprintf(err, errlen, "%s: %s is not an address of this machine", key, host);
            return -1;
        }
        return 0;
    }
    if (!interface_find(host, &lo)) {
        snprintf(err, errlen, "%s: \"%s\" is neither an IP address nor a network interface of "
                 "this machine with an IPv4 address (ZeroMQ binds addresses and interface names, "
                 "not host names)", key, host);
        return -1;
    }
    return 0;
}

int config_check_http_listen(const char *key, const char *hp, char *err, size_t errlen)
{
    char host[256];
    const char *port_text;
    unsigned char addr[sizeof(struct in6_addr)];
    if (split_hostport(hp, host, sizeof host, &port_text) || !host[0]) {
        snprintf(err, errlen, "%s: \"%s\" is not HOST:PORT", key, hp);
        return -1;
    }
    if (parse_port(port_text) < 0) {
        snprintf(err, errlen, "%s: port \"%s\" of \"%s\" is not 1..65535", key, port_text, hp);
        return -1;
    }
    if (!strcmp(host, "localhost"))
        return 0;
    int family = inet_pton(AF_INET, host, addr) == 1 ? AF_INET
               : inet_pton(AF_INET6, host, addr) == 1 ? AF_INET6 : 0;
    if (!family) {
        snprintf(err, errlen, "%s: \"%s\" is not an IP address", key, host);
        return -1;
    }
    if (!address_bindable(family, addr)) {
        snprintf(err, errlen, "%s: %s is not an address of this machine", key, host);
        return -1;
    }
    return 0;
}

int config_endpoint_loopback(const char *e)
{
    char host[256];
    const char *port_text;
    if (!strncmp(e, "tcp://", 6))
        e += 6;
    else if (strstr(e, "://"))
        return 1;   /* ipc:// and inproc:// are guarded by file permissions or the process */
    return !split_hostport(e, host, sizeof host, &port_text) && host_loopback(host);
}

int config_endpoint_ipv6(const char *e)
{
    return !strncmp(e, "tcp://", 6) && strchr(e + 6, '[') != NULL;
}


/* What a CUDA interception library does at its first CUDA call (gpu-manager's gpu-client): connect
 * to the pod's mounted vcuda.sock and call vcuda.VCUDAService/RegisterVDevice with the pod UID and
 * the container id, then exit 0 when the manager answered with a response message.
 *
 *   vcuda-register SOCKET POD_UID CONTAINER_ID [CONTAINER_NAME]
 *   vcuda-register --self SOCKET [READY_FILE]
 *
 * --self is the library's whole first step, in this one process: its pod UID and container id from
 * /proc/self/cgroup (the kubelet's .../pod<UID>/<CONTAINER_ID>), the registration, then its own
 * vcuda.config read beside the socket (<dir of SOCKET>/<CONTAINER_ID>/vcuda.config), which must be
 * the 8240 bytes vcuda-controller reads; exit 4 when it is not. READY_FILE, when given, is created
 * once all of that is done: the application's own "I am running" signal, from the same process, as an
 * application that makes CUDA calls gives it after its first one (bench/pod_start.py waits for it).
 *
 * A static binary with no gRPC library: gRPC here is one HTTP/2 stream over the unix socket (client
 * preface, SETTINGS, one HEADERS frame with literal HPACK fields, one DATA frame carrying the
 * length-prefixed protobuf message, written at once), and the answer is read frame by frame. A refused call has no
 * response message, only trailers: it exits 1 and prints the readable trailer text (the status code
 * and message when the server sent them without Huffman coding). Every wait is bounded (10 s). */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_FRAME 16384

static const char PATH[] = "/vcuda.VCUDAService/RegisterVDevice";

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n <= 0)
            die("write");
        p += n;
        len -= (size_t)n;
    }
}

static int read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* One frame appended at out; its size. */
static size_t put_frame(uint8_t *out, uint8_t type, uint8_t flags, uint32_t stream, const void *payload, size_t len) {
    uint8_t head[9] = {(uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len, type, flags,
                       (uint8_t)(stream >> 24), (uint8_t)(stream >> 16), (uint8_t)(stream >> 8), (uint8_t)stream};
    memcpy(out, head, sizeof head);
    if (len)
        memcpy(out + sizeof head, payload, len);
    return sizeof head + len;
}

static void frame(int fd, uint8_t type, uint8_t flags, uint32_t stream, const void *payload, size_t len) {
    static uint8_t out[9 + MAX_FRAME];
    write_all(fd, out, put_frame(out, type, flags, stream, payload, len));
}

/* A string of at most 126 bytes with a one-byte length (H bit clear: no Huffman coding). */
static size_t put_str(uint8_t *out, const char *s) {
    size_t n = strlen(s);
    if (n > 126) {
        fprintf(stderr, "value too long: %s\n", s);
        exit(2);
    }
    out[0] = (uint8_t)n;
    memcpy(out + 1, s, n);
    return n + 1;
}

static size_t put_field(uint8_t *out, uint8_t tag, const char *s) {
    size_t n = strlen(s);
    if (n > 127) {
        fprintf(stderr, "field too long: %s\n", s);
        exit(2);
    }
    out[0] = tag;
    out[1] = (uint8_t)n;
    memcpy(out + 2, s, n);
    return n + 2;
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "vcuda-register: no answer within 10 s\n";
    write(2, msg, sizeof msg - 1);
    _exit(3);
}

#define CONFIG_BYTES 8240

/* The pod UID and container id this process runs as: the last two parts of its kubepods cgroup path. */
static int own_ids(char *uid, size_t uid_size, char *cid, size_t cid_size) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f)
        die("/proc/self/cgroup");
    char line[1024];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        if (!strstr(line, "kubepods"))
            continue;
        line[strcspn(line, "\n")] = 0;
        char *last = strrchr(line, '/');
        if (!last || last == line)
            continue;
        *last = 0;
        char *pod = strrchr(line, '/');
        if (!pod || strncmp(pod + 1, "pod", 3) != 0)
            continue;
        snprintf(cid, cid_size, "%s", last + 1);
        snprintf(uid, uid_size, "%s", pod + 4);
        found = 1;
    }
    fclose(f);
    return found ? 0 : -1;
}

/* Exit 0 when <dir of sock>/<cid>/vcuda.config holds exactly CONFIG_BYTES, read through. */
static int read_config(const char *sock, const char *cid) {
    char path[512];
    const char *slash = strrchr(sock, '/');
    int dir = slash ? (int)(slash - sock) : 1;
    snprintf(path, sizeof path, "%.*s/%s/vcuda.config", dir, slash ? sock : ".", cid);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        die(path);
    static char buf[CONFIG_BYTES + 1];
    size_t total = 0;
    ssize_t n;
    while ((n = read(fd, buf + total, sizeof buf - total)) > 0 && (total += (size_t)n) < sizeof buf)
        ;
    close(fd);
    if (total != CONFIG_BYTES) {
        fprintf(stderr, "%s is %zu bytes, not %d\n", path, total, CONFIG_BYTES);
        return 4;
    }
    return 0;
}

static int register_vdevice(const char *sock, const char *uid, const char *cid, const char *name);

int main(int argc, char **argv) {
    signal(SIGALRM, on_alarm);
    alarm(10);
    if ((argc == 3 || argc == 4) && strcmp(argv[1], "--self") == 0) {
        char uid[128], cid[128];
        if (own_ids(uid, sizeof uid, cid, sizeof cid) < 0) {
            fprintf(stderr, "no kubepods cgroup in /proc/self/cgroup\n");
            return 2;
        }
        int rc = register_vdevice(argv[2], uid, cid, NULL);
        if (!rc)
            rc = read_config(argv[2], cid);
        if (!rc && argc == 4) {
            int fd = open(argv[3], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
            if (fd < 0)
                die(argv[3]);
            close(fd);
        }
        return rc;
    }
    if (argc < 4 || argc > 5) {
        fprintf(stderr, "usage: %s SOCKET POD_UID CONTAINER_ID [CONTAINER_NAME]\n       %s --self SOCKET [READY_FILE]\n",
                argv[0], argv[0]);
        return 2;
    }
    int rc = register_vdevice(argv[1], argv[2], argv[3], argc == 5 ? argv[4] : NULL);
    if (rc == 0)
        printf("registered\n");
    return rc;
}

/* RegisterVDevice over SOCKET; 0 when answered with a response message, else 1 (the trailers printed). */
static int register_vdevice(const char *sock, const char *uid, const char *cid, const char *name) {

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(sock) >= sizeof addr.sun_path) {
        fprintf(stderr, "socket path too long\n");
        return 2;
    }
    strcpy(addr.sun_path, sock);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket");
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0)
        die("connect");

    /* The whole call in one write, as a gRPC library sends a unary call's first flight: the
     * preface, SETTINGS, HEADERS, DATA (one wake-up of the server, not six). */
    static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    uint8_t call[2048];
    size_t c = sizeof preface - 1;
    memcpy(call, preface, c);
    c += put_frame(call + c, 4, 0, 0, NULL, 0); /* SETTINGS, all defaults */

    uint8_t hdr[512];
    size_t h = 0;
    hdr[h++] = 0x83; /* :method POST (static table 3) */
    hdr[h++] = 0x86; /* :scheme http (static table 6) */
    hdr[h++] = 0x04; /* :path, literal value without indexing */
    h += put_str(hdr + h, PATH);
    hdr[h++] = 0x01; /* :authority */
    h += put_str(hdr + h, "localhost");
    hdr[h++] = 0x00;
    h += put_str(hdr + h, "content-type");
    h += put_str(hdr + h, "application/grpc");
    hdr[h++] = 0x00;
    h += put_str(hdr + h, "te");
    h += put_str(hdr + h, "trailers");
    c += put_frame(call + c, 1, 0x4, 1, hdr, h); /* HEADERS, END_HEADERS */

    uint8_t msg[512];
    size_t m = 5; /* gRPC prefix: not compressed + 4-byte length */
    m += put_field(msg + m, 0x12, uid); /* VDeviceRequest.pod_uid = 2 */
    if (name)
        m += put_field(msg + m, 0x1a, name); /* container_name = 3 */
    m += put_field(msg + m, 0x22, cid); /* container_id = 4 */
    uint32_t body = (uint32_t)(m - 5);
    msg[0] = 0;
    msg[1] = (uint8_t)(body >> 24);
    msg[2] = (uint8_t)(body >> 16);
    msg[3] = (uint8_t)(body >> 8);
    msg[4] = (uint8_t)body;
    c += put_frame(call + c, 0, 0x1, 1, msg, m); /* DATA, END_STREAM */
    write_all(fd, call, c);

    static uint8_t payload[MAX_FRAME];
    int answered = 0, ended = 0;
    char trailers[4096] = "";
    size_t tlen = 0;
    while (!ended) {
        uint8_t head[9];
        if (read_all(fd, head, 9) < 0)
            break;
        uint32_t len = (uint32_t)head[0] << 16 | (uint32_t)head[1] << 8 | head[2];
        uint8_t type = head[3], flags = head[4];
        uint32_t stream = ((uint32_t)head[5] << 24 | (uint32_t)head[6] << 16 | (uint32_t)head[7] << 8 | head[8]) & 0x7fffffff;
        if (len > MAX_FRAME || read_all(fd, payload, len) < 0)
            break;
        if (type == 4 && !(flags & 0x1)) {
            frame(fd, 4, 0x1, 0, NULL, 0); /* SETTINGS ACK */
        } else if (type == 6 && !(flags & 0x1)) {
            frame(fd, 6, 0x1, 0, payload, len); /* PING ACK */
        } else if (stream == 1 && type == 0) {
            if (len >= 5)
                answered = 1;
            ended = flags & 0x1;
        } else if (stream == 1 && (type == 1 || type == 9)) {
            for (uint32_t i = 0; i < len && tlen + 1 < sizeof trailers; i++) /* the readable bytes */
                trailers[tlen++] = (payload[i] >= 0x20 && payload[i] < 0x7f) ? (char)payload[i] : ' ';
            trailers[tlen] = 0;
            ended = flags & 0x1;
        } else if ((stream == 1 && type == 3) || type == 7) {
            break; /* RST_STREAM or GOAWAY */
        }
    }
    close(fd);
    if (answered)
        return 0;
    printf("refused:%s\n", trailers);
    return 1;
}

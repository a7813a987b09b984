/* A FedAvg device written from docs/protocol.md: it follows rounds (section 11), keeps the
 * global model by dense and sparse deltas checked against the protocol 2 digest (section 7),
 * sends a perturbed copy of the model as its update (signed when given a key, section 6) and
 * answers FINISH with EVAL.  One thread: libmosquitto's callbacks run inside mosquitto_loop.
 *
 *   fcl-c-device --host H --port P --federation F --client C [--key FILE] [--samples N] [--timeout S]
 *   fcl-c-device --vectors DIR
 *
 * Exit status: 0 the run finished, 2 bad arguments, 3 timed out, 4 the aggregator does not
 * speak protocol 2, 7 the aggregator ended the run as failed, 8 a newer run started. */
#include <math.h>
#include <mosquitto.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "sha256.h"
#include "vectors.h"

#define SEQUENCE_AHEAD_US 10000000LL /* P-12.1 */
#define NREASONS 8

static const char *REASONS[NREASONS] = {"codec", "sender", "kind", "run", "model", "finish", "topic", "request"};

static struct {
    const char *fed, *client;
    uint8_t key[32];
    int signing, samples;
    struct mosquitto *mq;
    char t_round[200], t_update[200], t_status[200], t_full[200];
    char run[64];
    model held;
    int64_t version;           /* -1: holds no model */
    char digest[65];
    int64_t done_round;        /* the last round answered */
    uint8_t *unacked;          /* P-11.1: the last update, until a later round is announced */
    size_t unacked_len;
    uint64_t sequence;
    int64_t offset_us;         /* the aggregator's clock minus ours (meta.clock_us) */
    uint8_t *parked;           /* an announcement waiting for model/full */
    size_t parked_len;
    int fetching, eval_mid, stop_mid, exit_code, done;
    int dropped[NREASONS], verified, updates, resent, full_fetches;
} D = {.version = -1, .done_round = -1, .exit_code = -1};

static void logf_(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "c-device %s: ", D.client);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void drop(int reason, const char *detail) {
    D.dropped[reason]++;
    logf_("dropped downlink message: %s: %s", REASONS[reason], detail);
}

/* P-CAP-1: it derives no positions and reads no chunks, so it reads its own topic (P-CAP-2) */
#define DECODES                                                                                                    \
    "{\"frames\":[1,2],\"dtypes\":[\"float32\",\"float16\",\"int8\"],\"layouts\":[\"dense\",\"index\",\"bitmap\"]," \
    "\"derived_positions\":false,\"chunks\":false}"

static void publish_status(const char *state) {
    char buf[512];
    snprintf(buf, sizeof buf, "{\"state\":\"%s\",\"time\":%.3f,\"run\":\"%s\",\"round\":%lld,\"protocol\":4,\"decodes\":%s}",
             state, now_us() / 1e6, D.run, (long long)D.done_round, DECODES);
    mosquitto_publish(D.mq, strcmp(state, "stopped") ? NULL : &D.stop_mid, D.t_status, (int)strlen(buf), buf, 1, true);
}

static void fetch_full(int on) {
    if (on && !D.fetching) mosquitto_subscribe(D.mq, NULL, D.t_full, 1), D.full_fetches++;
    if (!on && D.fetching) mosquitto_unsubscribe(D.mq, NULL, D.t_full);
    D.fetching = on;
}

static void send_uplink(int kind, uint32_t round, uint32_t task, const char *meta, int ntensors, const tensor *t, int *mid) {
    int64_t now = now_us() + D.offset_us; /* P-12.1: microseconds on the aggregator's clock */
    if ((int64_t)D.sequence + 1 > now + SEQUENCE_AHEAD_US) D.sequence = (uint64_t)now;
    D.sequence = D.sequence + 1 > (uint64_t)now ? D.sequence + 1 : (uint64_t)now;
    size_t n;
    uint8_t *frame = frame_encode(kind, round, task, D.sequence, D.fed, D.client, meta, ntensors, t, &n);
    if (D.signing) { /* P-6.1 */
        uint8_t *env = malloc(n + 36);
        memcpy(env, "FCLS", 4);
        hmac_sha256(D.key, 32, frame, n, env + 4);
        memcpy(env + 36, frame, n);
        free(frame), frame = env, n += 36;
    }
    mosquitto_publish(D.mq, mid, D.t_update, (int)n, frame, 1, false);
    free(D.unacked);
    D.unacked = frame, D.unacked_len = n;
}

static void rejected_json(char *out, size_t len) {
    size_t w = (size_t)snprintf(out, len, "{");
    for (int i = 0; i < NREASONS; i++)
        if (D.dropped[i]) w += (size_t)snprintf(out + w, len - w, "%s\"%s\":%d", w > 1 ? "," : "", REASONS[i], D.dropped[i]);
    snprintf(out + w, len - w, "}");
}

static void send_update(uint32_t round, uint32_t task) {
    tensor *t = calloc(MAX_TENSORS, sizeof *t);
    for (int i = 0; i < D.held.ntensors; i++) { /* the update: the model, one entry in eight moved a little */
        t[i] = D.held.tensors[i];
        t[i].values = malloc(sizeof(float) * t[i].numel);
        for (uint64_t k = 0; k < t[i].numel; k++)
            t[i].values[k] = D.held.tensors[i].values[k] + ((k + round) % 8 ? 0.0f : 1e-3f * (float)sin((double)(k + round)));
    }
    char meta[512], rejected[256];
    rejected_json(rejected, sizeof rejected);
    snprintf(meta, sizeof meta, "{\"n_samples\":%d,\"train_nll\":null,\"rejected\":%s}", D.samples, rejected);
    send_uplink(K_UPDATE, round, task, meta, D.held.ntensors, t, NULL);
    for (int i = 0; i < D.held.ntensors; i++) free(t[i].values);
    free(t);
    D.done_round = round, D.updates++;
    publish_status("online");
    logf_("round %u task %u: update sent (model version %lld, digest %.16s...)", round, task, (long long)D.version, D.digest);
}

/* 1 when the device holds the model ref names (applied and its digest checked), else 0. */
static int take_model(const frame *f, const json *ref) {
    const json *version = json_get(ref, "version"), *base = json_get(ref, "base"), *digest = json_get(ref, "digest");
    int64_t v, b = -1;
    char err[300], got[65];
    if (!digest || digest->type != J_STR || !json_int(version, &v)) {
        logf_("meta.model has no protocol 2 digest: this aggregator speaks protocol 1 only");
        D.exit_code = 4;
        return 0;
    }
    if (v == D.version && !strcmp(digest->text, D.digest)) return 1;
    if (base && base->type != J_NULL && (!json_int(base, &b) || D.version < b || D.version >= v)) return 0; /* P-7.3 */
    model next;
    if (model_apply(&D.held, f, ref, &next, err, sizeof err)) {
        drop(4, err);
        return 0;
    }
    model_digest(&next, got);
    if (strcmp(got, digest->text)) { /* P-7.3: never kept */
        drop(4, "digest mismatch");
        model_free(&next);
        return 0;
    }
    model_free(&D.held);
    D.held = next, D.version = v, D.verified++;
    memcpy(D.digest, got, sizeof got);
    return 1;
}

static void park(const uint8_t *buf, size_t n) {
    if (buf != D.parked) {
        free(D.parked);
        D.parked = malloc(n), D.parked_len = n;
        memcpy(D.parked, buf, n);
    }
    fetch_full(1);
}

static void finish(const frame *f) {
    char meta[300], rejected[256];
    rejected_json(rejected, sizeof rejected);
    snprintf(meta, sizeof meta, "{\"rejected\":%s}", rejected);
    send_uplink(K_EVAL, f->round, f->task, meta, 0, NULL, &D.eval_mid); /* P-11.3; then "stopped" once delivered */
    logf_("run finished: %d updates, %d models verified, %d re-sends", D.updates, D.verified, D.resent);
}

static void resend(uint32_t round, const char *why) {
    if ((int64_t)round != D.done_round || !D.unacked) return;
    mosquitto_publish(D.mq, NULL, D.t_update, (int)D.unacked_len, D.unacked, 1, false); /* P-11.1: the same bytes */
    D.resent++;
    logf_("re-sent the update for round %u: %s", round, why);
}

static int names_me(const json *missing) {
    for (const json *c = missing ? missing->child : NULL; c; c = c->next)
        if (c->type == J_STR && !strcmp(c->text, D.client)) return 1;
    return 0;
}

static void on_round_frame(const uint8_t *buf, size_t n) {
    frame f;
    char err[512];
    if (frame_decode(buf, n, &f, err, sizeof err)) { drop(0, err); frame_free(&f); return; }
    const json *run = json_get(f.meta, "run"), *clock = json_get(f.meta, "clock_us"), *model_ref = json_get(f.meta, "model");
    int64_t clock_us, total;
    if (strcmp(f.client, "aggregator") || strcmp(f.federation, D.fed)) drop(1, f.client); /* P-4.3 */
    else if (f.kind != K_ROUND && f.kind != K_FINISH && f.kind != K_REQUEST && f.kind != K_MODEL) drop(2, KIND_NAMES[f.kind]);
    else if (!run || run->type != J_STR || strlen(run->text) != 25) drop(3, "no run id");
    else if (D.run[0] && strcmp(run->text, D.run) < 0) drop(3, "an earlier run"); /* P-9.2 */
    else if (D.run[0] && strcmp(run->text, D.run) > 0 && f.kind != K_MODEL) {
        logf_("a newer run %s started: refusing it", run->text);
        D.exit_code = 8;
    } else if (f.kind == K_REQUEST) {
        if (names_me(json_get(f.meta, "missing")) && !strcmp(run->text, D.run)) resend(f.round, "the aggregator asked");
    } else if (!D.run[0] && f.kind != K_ROUND) {
        drop(f.kind == K_MODEL ? 3 : 5, "not in a run yet");
    } else if (f.kind == K_FINISH && json_get(f.meta, "failed")) {
        logf_("the aggregator ended the run as failed");
        D.exit_code = 7;
    } else if (f.kind == K_FINISH && (!json_int(json_get(f.meta, "total_rounds"), &total) || total != f.round)) {
        drop(5, "not the end of the last round");
    } else if (f.kind == K_MODEL && strcmp(run->text, D.run)) {
        drop(3, "a model of another run");
    } else if (f.kind == K_MODEL) {
        if (take_model(&f, model_ref) && D.parked) { /* the parked announcement goes on */
            uint8_t *p = D.parked;
            size_t pn = D.parked_len;
            D.parked = NULL;
            frame_free(&f);
            on_round_frame(p, pn);
            free(p);
            return;
        }
    } else {
        snprintf(D.run, sizeof D.run, "%s", run->text);
        if (json_int(clock, &clock_us) && clock_us > 0) D.offset_us = clock_us - now_us();
        if (f.kind == K_ROUND && (int64_t)f.round <= D.done_round) resend(f.round, "its round is announced again");
        else if (!take_model(&f, model_ref)) { if (D.exit_code < 0) park(buf, n); }
        else {
            fetch_full(0);
            if (f.kind == K_ROUND) send_update(f.round, f.task);
            else finish(&f);
        }
    }
    frame_free(&f);
}

static void on_message(struct mosquitto *mq, void *obj, const struct mosquitto_message *msg) {
    (void)mq, (void)obj;
    if (!msg->payloadlen) return; /* P-2.5: a deleted retained message */
    if (strcmp(msg->topic, D.t_round) && strcmp(msg->topic, D.t_full)) { drop(6, msg->topic); return; } /* P-3.2 */
    on_round_frame(msg->payload, (size_t)msg->payloadlen);
}

static void on_connect(struct mosquitto *mq, void *obj, int rc) {
    (void)obj;
    if (rc) { logf_("connection refused: %s", mosquitto_connack_string(rc)); return; }
    mosquitto_subscribe(mq, NULL, D.t_round, 1); /* P-2.2: a clean session subscribes again */
    if (D.fetching) mosquitto_subscribe(mq, NULL, D.t_full, 1);
    publish_status("online");
}

static void on_publish(struct mosquitto *mq, void *obj, int mid) {
    (void)obj;
    if (D.eval_mid && mid == D.eval_mid) D.eval_mid = 0, publish_status("stopped");
    else if (D.stop_mid && mid == D.stop_mid) D.done = 1, D.exit_code = 0, mosquitto_disconnect(mq);
}

static int read_key(const char *path) {
    char text[80] = {0};
    FILE *fp = fopen(path, "r");
    if (!fp || !fgets(text, sizeof text, fp)) return -1;
    fclose(fp);
    text[strcspn(text, " \r\n")] = 0;
    size_t n;
    uint8_t *key = unhex(text, &n);
    int ok = strlen(text) == 64 && key;
    if (ok) memcpy(D.key, key, 32);
    free(key);
    return ok ? 0 : -1;
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1", *key = NULL;
    int port = 1883, timeout_s = 600;
    D.samples = 50;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--vectors")) return check_vectors(v) ? 1 : 0;
        if (!strcmp(a, "--host")) host = v;
        else if (!strcmp(a, "--port")) port = atoi(v);
        else if (!strcmp(a, "--federation")) D.fed = v;
        else if (!strcmp(a, "--client")) D.client = v;
        else if (!strcmp(a, "--key")) key = v;
        else if (!strcmp(a, "--samples")) D.samples = atoi(v);
        else if (!strcmp(a, "--timeout")) timeout_s = atoi(v);
        else { fprintf(stderr, "unknown option %s\n", a); return 2; }
    }
    if (!D.fed || !D.client || D.samples < 1) {
        fprintf(stderr, "usage: fcl-c-device --host H --port P --federation F --client C [--key FILE] [--samples N]\n"
                        "       fcl-c-device --vectors DIR\n");
        return 2;
    }
    if (key && read_key(key)) { fprintf(stderr, "%s: expected 64 hex digits\n", key); return 2; }
    D.signing = key != NULL;
    snprintf(D.t_round, sizeof D.t_round, "fcl/%s/down/%s", D.fed, D.client); /* P-CAP-2: not fcl/<fed>/round */
    snprintf(D.t_update, sizeof D.t_update, "fcl/%s/update/%s", D.fed, D.client);
    snprintf(D.t_status, sizeof D.t_status, "fcl/%s/status/%s", D.fed, D.client);
    snprintf(D.t_full, sizeof D.t_full, "fcl/%s/model/full", D.fed);
    char id[200], will[64];
    snprintf(id, sizeof id, "fcl-%s-%s", D.fed, D.client); /* P-2.2 */
    snprintf(will, sizeof will, "{\"state\":\"dead\",\"time\":%.3f}", now_us() / 1e6);
    mosquitto_lib_init();
    D.mq = mosquitto_new(id, true, NULL);
    mosquitto_will_set(D.mq, D.t_status, (int)strlen(will), will, 1, true); /* P-2.3 */
    mosquitto_connect_callback_set(D.mq, on_connect);
    mosquitto_message_callback_set(D.mq, on_message);
    mosquitto_publish_callback_set(D.mq, on_publish);
    D.sequence = (uint64_t)now_us();
    time_t deadline = time(NULL) + timeout_s;
    int rc = mosquitto_connect(D.mq, host, port, 30);
    while (!D.done && D.exit_code < 0 && time(NULL) < deadline) {
        if (rc != MOSQ_ERR_SUCCESS) { /* the broker went away: try again, the retained round follows */
            sleep(1);
            rc = mosquitto_reconnect(D.mq);
            continue;
        }
        rc = mosquitto_loop(D.mq, 1000, 1);
    }
    if (D.exit_code < 0) logf_("timed out after %d s", timeout_s), D.exit_code = 3;
    printf("updates=%d verified=%d resent=%d full_fetches=%d", D.updates, D.verified, D.resent, D.full_fetches);
    for (int i = 0; i < NREASONS; i++) printf(" dropped_%s=%d", REASONS[i], D.dropped[i]);
    printf("\n");
    mosquitto_destroy(D.mq);
    mosquitto_lib_cleanup();
    model_free(&D.held);
    free(D.unacked), free(D.parked);
    return D.exit_code;
}

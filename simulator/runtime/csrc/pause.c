/* The pod sandbox's process (gpuledger's own "pause"): it holds the pod's namespaces, reaps any
 * child re-parented to it, and exits at SIGTERM or SIGINT. Built statically by
 * simulator/runtime/images.py into localhost/gpuledger/pause. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stopping;

static void on_stop(int sig) { (void)sig; stopping = 1; }

static void on_child(int sig) {
    (void)sig;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    sigemptyset(&stop.sa_mask);
    sigemptyset(&child.sa_mask);
    if (sigaction(SIGTERM, &stop, NULL) || sigaction(SIGINT, &stop, NULL) || sigaction(SIGCHLD, &child, NULL)) {
        perror("pause: sigaction");
        return 1;
    }
    while (!stopping)
        pause();
    return 0;
}

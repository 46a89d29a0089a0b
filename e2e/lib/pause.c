/* The pod sandbox process of the e2e cluster: sleeps until SIGINT/SIGTERM and
 * reaps zombies (it is PID 1 of the pod when the PID namespace is shared).
 * Built with `gcc -static` by e2e/images.sh; no registry is needed. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { _exit(128 + sig); }

static void on_chld(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        printf("pause (modelcache-csi e2e)\n");
        return 0;
    }
    if (getpid() != 1)
        fprintf(stderr, "pause: warning: not PID 1\n");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    if (sigaction(SIGINT, &sa, NULL) < 0 || sigaction(SIGTERM, &sa, NULL) < 0)
        return 1;
    sa.sa_handler = on_chld;
    sa.sa_flags = SA_NOCLDSTOP;
    if (sigaction(SIGCHLD, &sa, NULL) < 0)
        return 2;
    for (;;)
        pause();
}

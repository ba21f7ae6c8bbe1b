/* Extra command-line arguments for a program, read from a file, so that they never appear on its command line
 * (/proc/PID/cmdline, which ps shows to every local user). Clover preloads it (LD_PRELOAD) into tritonserver, which
 * takes its admin key only as an argument (--http-restricted-api=APIS:clover-admin-key=KEY); see
 * clover/serving/hidden_args.py.
 *
 * It wraps glibc's __libc_start_main, which calls main: main gets the arguments of the command line followed by
 * one per line of the file named by $CLOVER_HIDDEN_ARGS_FILE, while the kernel's copy of the command line, which
 * /proc shows, stays as it was. The file is removed once read (its removal tells Clover the arguments were taken),
 * and the variables are undone so that the program's own children (Triton's Python stubs) do not load this. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FILE_ENV "CLOVER_HIDDEN_ARGS_FILE"
#define PRELOAD_BEFORE_ENV "CLOVER_HIDDEN_ARGS_PRELOAD" /* LD_PRELOAD as it was before Clover's */

extern char **environ;

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_fn)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *);

static void fail(const char *what, const char *path) {
    /* no main without its arguments: tritonserver without its admin key would leave the admin APIs open */
    fprintf(stderr, "clover hidden_args: %s %s\n", what, path);
    _exit(2);
}

static char **grow(char **list, size_t *capacity) {
    *capacity *= 2;
    char **bigger = realloc(list, *capacity * sizeof *list);
    if (!bigger) fail("out of memory reading", "");
    return bigger;
}

/* argv, then one argument per line of path, then NULL and the environment (glibc may look for it there). */
static char **with_file_args(const char *path, int argc, char **argv, int *new_argc) {
    FILE *file = fopen(path, "r");
    if (!file) fail("cannot read", path);
    size_t capacity = (size_t)argc + 16, count = (size_t)argc;
    char **args = malloc(capacity * sizeof *args);
    if (!args) fail("out of memory reading", path);
    memcpy(args, argv, (size_t)argc * sizeof *args);
    char *line = NULL;
    size_t size = 0;
    ssize_t length;
    while ((length = getline(&line, &size, file)) >= 0) {
        if (length > 0 && line[length - 1] == '\n') line[length - 1] = '\0';
        if (count + 1 >= capacity) args = grow(args, &capacity);
        args[count++] = strdup(line);
    }
    free(line);
    fclose(file);
    *new_argc = (int)count;
    args[count++] = NULL;
    for (char **env = environ; ; env++) {
        if (count >= capacity) args = grow(args, &capacity);
        args[count++] = *env;
        if (!*env) break;
    }
    return args;
}

static void undo_environment(void) {
    const char *before = getenv(PRELOAD_BEFORE_ENV);
    if (before && *before) setenv("LD_PRELOAD", before, 1);
    else unsetenv("LD_PRELOAD");
    unsetenv(PRELOAD_BEFORE_ENV);
    unsetenv(FILE_ENV);
}

int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
                      void (*rtld_fini)(void), void *stack_end) {
    start_fn start = (start_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    if (!start) fail("cannot find", "__libc_start_main");
    const char *path = getenv(FILE_ENV);
    if (path) {
        char *own = strdup(path);
        argv = with_file_args(own, argc, argv, &argc);
        if (unlink(own) != 0) fail("cannot remove", own);
        free(own);
        undo_environment();
    }
    return start(main, argc, argv, init, fini, rtld_fini, stack_end);
}

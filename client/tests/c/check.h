/* What the C test programs share: a count of failed checks, and the calling thread's last
 * error message. */

#ifndef NETAGG_TEST_CHECK_H
#define NETAGG_TEST_CHECK_H

#include "netagg.h"

static int failures = 0;

static const char *last_error(void) {
  static char message[4096];
  size_t length = 0;
  if (netagg_last_error_message(message, sizeof message, &length) != NETAGG_OK) {
    return "(no message)";
  }
  return message;
}

#endif

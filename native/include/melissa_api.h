/* Melissa's header name: a Melissa simulation's #include <melissa_api.h> compiles unchanged. */
#include "melissa/api.h"

/* The C ABI from C: version, a config normalised by the library, a context made and released. */
#include <stdio.h>

#include "latentmoe/c_api.h"

int main(void) {
  const char* config =
      "{\"hidden_size\": 64, \"moe_latent_size\": 32, \"num_experts\": 8, "
      "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32, \"hidden_act\": \"silu\"}";
  char normalized[2048];
  size_t needed = 0;
  if (lmoe_abi_version() != LMOE_ABI_VERSION) return 1;
  if (lmoe_config_normalize(config, normalized, sizeof normalized, &needed) != LMOE_OK) return 2;
  lmoe_context_options options = {sizeof(lmoe_context_options), LMOE_DEVICE_CPU, 0, 16};
  lmoe_context* context = NULL;
  if (lmoe_context_create(&options, &context) != LMOE_OK) return 3;
  options.max_tokens = 0; /* refused, with the library's message */
  lmoe_context* refused = NULL;
  if (lmoe_context_create(&options, &refused) != LMOE_INVALID_ARGUMENT || refused != NULL) return 4;
  printf("consumer_c: latentmoe %s (C ABI %d): %s; refused: %s\n", lmoe_version(), lmoe_abi_version(), normalized,
         lmoe_last_error());
  return lmoe_context_destroy(context) == LMOE_OK ? 0 : 5;
}

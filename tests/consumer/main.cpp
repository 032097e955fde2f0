// One rank of a Kimi-K3-like layer through the installed C++ library: the README's ten lines.
#include <cmath>
#include <cstdio>

#include "latentmoe/in_process_group.h"
#include "latentmoe/presets.h"
#include "latentmoe/random.h"
#include "latentmoe/runner.h"

int main() {
  using namespace latentmoe;
  const LayerConfig config = resized(kimi_k3_config(), {64, 32, 8, 2, 32, 64});
  auto group = make_in_process_group(1);
  Runner runner(config, {1, 0}, make_random_layer_weights(config, DType::f32, 1), *group[0], {.max_tokens = 4});
  const HostTensor x = random_uniform_tensor(DType::f32, {3, config.hidden_size}, 2);
  HostTensor out(DType::f32, {3, config.hidden_size});
  runner.forward({x.view()}, {out.view()});
  const float first = out.data_as<float>()[0];
  std::printf("consumer_cpp: latentmoe %s, out[0] = %g\n", LATENTMOE_VERSION, first);
  return std::isfinite(first) ? 0 : 1;
}

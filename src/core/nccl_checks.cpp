#include "core/nccl_checks.h"

#include "core/settings.h"
#include "latentmoe/error.h"

namespace latentmoe::detail {

std::string nccl_version_text(int code) {
  // NCCL_VERSION(X, Y, Z): X * 1000 + Y * 100 + Z up to 2.8, X * 10000 + Y * 100 + Z from 2.9 on.
  int major = 0, minor = 0, patch = 0;
  if (code >= 10000) {
    major = code / 10000;
    minor = code / 100 % 100;
    patch = code % 100;
  } else {
    major = code / 1000;
    minor = code / 100 % 10;
    patch = code % 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::optional<std::string> nccl_version_mismatch(int loaded_code, int built_code) {
  if (loaded_code == built_code) return std::nullopt;
  return "NCCL version mismatch: latentmoe was built against NCCL " + nccl_version_text(built_code) +
         " but this process loaded libnccl " + nccl_version_text(loaded_code) +
         "; NCCL's device API (the symmetric-window peer pointers latentmoe reads) has no ABI compatibility "
         "across releases. Run against the libnccl " +
         nccl_version_text(built_code) +
         ", e.g. LD_LIBRARY_PATH=\"$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')/lib\" "
         "where PyTorch ships it, or rebuild latentmoe against the loaded one";
}

std::optional<std::string> nvls_problem(std::optional<int64_t> value) {
  if (value == 0) return std::nullopt;
  const std::string why =
      "; expected 0: latentmoe keeps NVLS off (it can put GPUs shared with others out of service) and sets no NCCL "
      "variable itself; set NCCL_NVLS_ENABLE=0 before NCCL starts";
  if (!value.has_value()) {
    return "NCCL_NVLS_ENABLE is not set, so NCCL uses NVLink multicast (NVLS) where the GPUs have it" + why +
           " (the latentmoe tool does)";
  }
  return "NCCL_NVLS_ENABLE='" + std::to_string(*value) + "' lets NCCL use NVLink multicast (NVLS)" + why;
}

void require_nvls_off() {
  if (auto problem = nvls_problem(read_integer(Setting::nccl_nvls_enable)))
    throw Error(*problem);  // the library's own message, whole
}

GpuPlacement choose_gpu_placement(GpuPlacement requested, int tp_size, int device_count, bool peers_ok,
                                  const std::string& nccl_problem, std::string* why) {
  std::string reason;
  if (!nccl_problem.empty()) {
    reason = nccl_problem;
  } else if (device_count < tp_size) {
    reason = std::to_string(device_count) + " GPU" + (device_count == 1 ? "" : "s") + " present";
  } else if (!peers_ok) {
    reason = "the first " + std::to_string(tp_size) + " GPUs lack peer access between some pair";
  }
  const bool devices_ok = reason.empty();
  if (requested == GpuPlacement::devices) {
    LATENTMOE_CHECK(devices_ok, "placement devices: tp ", tp_size, " needs ", tp_size,
                    " GPUs with peer access and NCCL, but ", reason);
  }
  const GpuPlacement placement =
      requested == GpuPlacement::automatic ? (devices_ok ? GpuPlacement::devices : GpuPlacement::simulated) : requested;
  if (why != nullptr) {
    if (placement == GpuPlacement::devices) {
      *why =
          std::to_string(tp_size) + " ranks on GPUs 0.." + std::to_string(tp_size - 1) + ", one thread per GPU (NCCL)";
    } else {
      *why = std::to_string(tp_size) + " ranks simulated on GPU 0" +
             (requested == GpuPlacement::simulated ? std::string(" (placement simulated)") : " (" + reason + ")");
    }
  }
  return placement;
}

}  // namespace latentmoe::detail

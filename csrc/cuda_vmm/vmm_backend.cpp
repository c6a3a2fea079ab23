#include "vmm_backend.h"

#include <cstring>

#include "errors.h"

namespace vattn {

void throw_errno(const std::string& call, int err) {
  throw DriverError(call, "errno " + std::to_string(err) + " (" + std::strerror(err) + ")");
}

Reservation::Reservation(std::shared_ptr<VmmBackend> backend, size_t bytes)
    : backend_(std::move(backend)), base_(0), bytes_(bytes) {
  base_ = backend_->reserve(bytes);
}

Reservation::~Reservation() { backend_->free_reservation(base_, bytes_); }

}  // namespace vattn

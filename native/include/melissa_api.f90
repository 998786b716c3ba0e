! Melissa's Fortran API (INRIA Melissa's melissa_api.f90, an include file), implemented
! on libmelissa_dl_fortran. A Melissa simulation compiles unchanged:
!
!     use mpi                                                    ! or include "mpif.h"
!     implicit none
!     include "melissa_api.f90"
!     call melissa_init("temperature", local_size, MPI_COMM_WORLD)  ! once per field
!     do t = 1, steps
!        call melissa_send("temperature", u)   ! local_size doubles: the field's next step
!     end do
!     call melissa_finalize()
!
!     mpifort sim.f90 $(pkg-config --cflags --libs melissa_dl_fortran)
!
! Field names are Fortran strings, NUL-terminated or not (Melissa asks for
! name // C_NULL_CHAR; a NUL and what follows it, and trailing blanks, are
! dropped); communicators are integer handles. A call that fails prints one
! line naming the call and the field and stops the process (melissa/api.h).
interface
  subroutine melissa_init(field_name, local_vect_size, comm)
    character(len=*), intent(in) :: field_name
    integer, intent(in) :: local_vect_size, comm
  end subroutine melissa_init

  subroutine melissa_send(field_name, send_vect)
    use, intrinsic :: iso_c_binding, only: c_double
    character(len=*), intent(in) :: field_name
    real(c_double), intent(in) :: send_vect(*)
  end subroutine melissa_send

  subroutine melissa_finalize() bind(C, name="melissa_finalize")
  end subroutine melissa_finalize
end interface
